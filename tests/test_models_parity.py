"""Our forward pass against transformers' on the same weights, float32.

Per-token logprobs of several prompts agree within 1e-4; greedy continuations of up to 32 tokens are
identical (and their logprobs agree too) up to the first near-tie: a step where the reference's top two
logits are closer than NEAR_TIE, where a 1e-6 difference in arithmetic may legitimately pick the other
token and everything after it differs. The comparison stops there, and the margin is printed. Tiny random models of each supported family are built at
test time; SmolLM2 (the default model) runs too, marked smollm2.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from steadyserve.config import EngineConfig
from steadyserve.engine.engine import LLMEngine
from steadyserve.engine.offline import run_requests
from steadyserve.engine.selftest import run_selftest
from steadyserve.engine.sequence import Request, SamplingParams
from steadyserve.models.loader import LoadedModel, load_model
from steadyserve.testing import build_tiny_model

TOL = 1e-4
THREADS = int(os.environ.get("STEADYSERVE_TEST_THREADS", "1"))  # 2 threads crawl on a shared 2-core box
GREEDY = 32
NEAR_TIE = 1e-3  # 10x TOL: top-2 logits closer than this may swap between two correct implementations
TEXTS = [
    "The quick brown fox",
    "Streams end with a finish reason or an error. Logprobs are identical whatever shares the batch. "
    "A model server must stay correct under load, and so it does.",
    "Überall façade naïve café — 日本語のテキスト, emoji 🙂🚀",
]


def make_engine(loaded: LoadedModel, selftest: bool = True) -> LLMEngine:
    engine = LLMEngine(loaded, EngineConfig(kv_cache_memory=32 * 1024**2, threads=THREADS,
                                            max_num_batched_tokens=512, batch_invariant=loaded.model.tiler.enabled or loaded.model.native))
    if loaded.model.tiler.enabled:  # what the server runs: the verified tile ladder
        if selftest:
            assert run_selftest(engine).passed
        else:
            loaded.model.calibrate()
    return engine


def prompts_for(tokenizer, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    ps = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    ps.append([rng.randrange(vocab) for _ in range(70)])  # spans 3 KV blocks of 32
    return ps


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return m.eval()


@torch.inference_mode()
def hf_prompt_logprobs(model, ids: list[int]) -> torch.Tensor:
    """Logprob of prompt token i (i >= 1) given the tokens before it."""
    logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


@torch.inference_mode()
def hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float], list[float]]:
    """Greedy tokens, their logprobs, and the margin between the top two logits at each step."""
    out = model(torch.tensor([ids]), use_cache=True)
    toks, lps, margins = [], [], []
    for _ in range(n):
        logits = out.logits[0, -1].float()
        lp = torch.log_softmax(logits, dim=-1)
        top2 = torch.topk(logits, 2).values
        t = int(torch.argmax(lp))
        toks.append(t)
        lps.append(float(lp[t]))
        margins.append(float(top2[0] - top2[1]))
        out = model(torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
    return toks, lps, margins


def until_near_tie(margins: list[float]) -> int:
    """How many greedy tokens are safe to compare: those before the first step with a near-tie."""
    return next((i for i, m in enumerate(margins) if m < NEAR_TIE), len(margins))


def check_parity(name: str, loaded: LoadedModel, hf_path: str, prompts: list[list[int]],
                 selftest: bool = True, ref=None) -> float:
    """Assert parity with transformers (`ref`, default: hf_path loaded by it); return the max logprob diff."""
    engine = make_engine(loaded, selftest)
    ref = ref if ref is not None else hf_model(hf_path)
    reqs = []
    for i, p in enumerate(prompts):
        reqs.append(Request(f"score{i}", p, SamplingParams(max_tokens=0, prompt_logprobs=0)))
        reqs.append(Request(f"gen{i}", p, SamplingParams(max_tokens=GREEDY, temperature=0, logprobs=0,
                                                        ignore_eos=True)))
    done = run_requests(engine, reqs)  # all at once: parity holds inside a batch too
    worst = 0.0
    compared = []
    for i, p in enumerate(prompts):
        ours = torch.tensor(done[f"score{i}"].prompt_logprob_values, dtype=torch.float64)
        theirs = hf_prompt_logprobs(ref, p).double()
        assert ours.shape == theirs.shape
        diff = float((ours - theirs).abs().max())
        worst = max(worst, diff)
        assert diff <= TOL, f"{name} prompt {i}: max |logprob diff| {diff:.3g}"
        g = done[f"gen{i}"]
        toks, lps, margins = hf_greedy(ref, p, GREEDY)
        assert g.finish_reason == "length" and len(g.token_ids) == GREEDY
        n = until_near_tie(margins)  # the first near-tie token itself is not compared: either pick is right
        compared.append(n)
        assert g.token_ids[:n] == toks[:n], (f"{name} prompt {i}: greedy continuations differ before any near-tie "
                                             f"(first near-tie at {n}; margins {[round(m, 4) for m in margins]})")
        if n:
            gdiff = float((torch.tensor(g.logprob_values[:n], dtype=torch.float64)
                           - torch.tensor(lps[:n])).abs().max())
            worst = max(worst, gdiff)
            assert gdiff <= TOL, f"{name} prompt {i}: greedy logprob diff {gdiff:.3g}"
    print(f"\nPARITY {name}: max |logprob diff| {worst:.3g} over {len(prompts)} prompts; greedy tokens identical "
          f"for {compared} of {GREEDY} (cut at the first top-2 margin < {NEAR_TIE})")
    assert sum(compared) > 0, f"{name}: every prompt hit a near-tie at its first token; nothing was compared"
    return worst


ARCHS = ["llama", "qwen2", "llama3", "mistral"]


@pytest.fixture(scope="module")
def arch_dirs(models_dir: Path, tiny_model: str, tiny_qwen2: str) -> dict[str, str]:
    dirs = {"llama": tiny_model, "qwen2": tiny_qwen2}
    for arch in ("llama3", "mistral"):
        dirs[arch] = str(build_tiny_model(models_dir / f"tiny-{arch}", arch=arch))
    # Mistral with a sliding window shorter than the prompts.
    sw = models_dir / "tiny-mistral-window"
    if not sw.exists():
        build_tiny_model(sw, arch="mistral", seed=1)
        cfg = json.loads((sw / "config.json").read_text())
        cfg["sliding_window"] = 16
        (sw / "config.json").write_text(json.dumps(cfg))
    dirs["mistral-window16"] = str(sw)
    return dirs


@pytest.mark.parametrize("arch", ARCHS + ["mistral-window16"])
@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "plain"])
def test_tiny_parity(arch_dirs, arch, invariant):
    path = arch_dirs[arch]
    # float32 parity: the portable path (the default int8 path's quantization error is measured, not bounded here)
    loaded = load_model(path, batch_invariant=invariant, max_model_len=512, numerics="portable" if invariant else "auto")
    check_parity(f"tiny-{arch}-{'bi' if invariant else 'plain'}", loaded, path,
                 prompts_for(loaded.tokenizer, loaded.args.vocab_size))


def test_tiny_models_have_the_features_under_test(arch_dirs):
    qwen = load_model(arch_dirs["qwen2"])
    assert qwen.args.qkv_bias and not qwen.args.tie_word_embeddings
    assert qwen.model.lm_head is not qwen.model.embed
    llama = load_model(arch_dirs["llama"])
    assert llama.args.tie_word_embeddings and llama.args.num_kv_heads < llama.args.num_heads
    l3 = load_model(arch_dirs["llama3"])
    assert l3.args.hf_config.rope_scaling["rope_type"] == "llama3"
    assert load_model(arch_dirs["mistral-window16"], max_model_len=512).args.sliding_window == 16


@pytest.mark.smollm2
@pytest.mark.models  # against transformers on the real file: make test-models
def test_smollm2_parity(smollm2):
    tok = smollm2.loaded.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in ("What is the capital of France?",)]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]
    prompts += [tok.encode("The history of the printing press begins in", add_special_tokens=False),
                tok.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
                           add_special_tokens=False)]
    portable = load_model("", numerics="portable")  # float32 parity is the portable path's (the cache is warm)
    check_parity("SmolLM2-135M", portable, smollm2.hf_dir, prompts, selftest=False)
