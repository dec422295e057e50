"""gpt-oss (models/gptoss.py) on a tiny random model: parity with transformers on every numerics path, each of its
features shown to matter (a parity check that passes with one dropped would prove nothing), batch invariance of the
engine with a TEST-ONLY break it must catch, the router's ties under its top-k-then-softmax order, and its clamped
SwiGLU kernel.

The model: transformers' GptOssForCausalLM from a config with a fixed seed (testing/tiny_model.py "gptoss": 2 layers,
hidden 64, 4 heads of 16 over 2 KV heads, 8 experts of width 32, top-2, a sliding window of 16 on layer 0 and a
full layer 1, YaRN, biases on attention, router and experts, attention sinks of the scores' size, and a SwiGLU limit
of 0.6 so the clamps bite). The prompts (test_models_parity.prompts_for) run past the window.

The same model as a Q8_0 GGUF written by llama.cpp's own converter (testing/llama_converter.py). transformers cannot
read that file (its gpt-oss GGUF map fails on the converter's rope.scaling keys), so its reference is transformers on
the checkpoint's weights rounded as the converter rounds them (gguf-py's Q8_0, row by row along K), with the SwiGLU
limit llama.cpp hardcodes (7.0: a GGUF has no key for it). The engine's invariance checks run on that file's default
path (int8: the experts packed and grouped, their biases added per group).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx
import pytest
import torch

from steadyserve.engine.selftest import run_selftest
from steadyserve.kernels import load
from steadyserve.models import moe, registry
from steadyserve.models.gptoss import swiglu_oai
from steadyserve.models.loader import load_model
from steadyserve.testing import build_tiny_model
from steadyserve.testing.llama_converter import convert as llama_cpp_convert
from steadyserve.testing.server import ServerProcess
from test_engine_invariance import engine_for
from test_models_parity import check_parity, prompts_for

pytestmark = pytest.mark.skipif(not load().available, reason="native kernels not built")


@pytest.fixture(scope="module")
def tiny(models_dir: Path) -> str:
    d = models_dir / "tiny-gptoss"
    if not d.exists():
        build_tiny_model(d, arch="gptoss")
    return str(d)


@pytest.fixture(scope="module")
def tiny_gguf(tiny, models_dir: Path) -> str:
    g = models_dir / "tiny-gptoss.gguf"
    if not g.exists():
        llama_cpp_convert({Path(tiny): g})
    return str(g)


def gguf_reference(hf_dir: str):
    """transformers' GptOssForCausalLM on the checkpoint's weights as the converter's Q8_0 file holds them, with
    llama.cpp's SwiGLU limit (module docstring)."""
    from gguf import GGMLQuantizationType, quants
    from transformers import AutoConfig, GptOssForCausalLM

    def q8(w: torch.Tensor) -> torch.Tensor:  # rows along the last dim, as the GGUF's (N, K) rows
        q = quants.quantize(w.contiguous().numpy(), GGMLQuantizationType.Q8_0)
        return torch.from_numpy(quants.dequantize(q, GGMLQuantizationType.Q8_0).copy())

    cfg = AutoConfig.from_pretrained(hf_dir)
    cfg.swiglu_limit = 7.0
    model = GptOssForCausalLM.from_pretrained(hf_dir, config=cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("proj.weight", "embed_tokens.weight")) or name == "lm_head.weight":
                p.copy_(q8(p))
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # (E, K, N): K is the middle dim
                p.copy_(q8(p.transpose(1, 2)).transpose(1, 2))
    return model


# ---- parity with transformers ------------------------------------------------------------------------------------

@pytest.mark.parametrize("numerics", ["portable", "host"])
def test_parity_with_transformers(tiny, numerics, tmp_path):
    loaded = load_model(tiny, max_model_len=512, cache_dir=str(tmp_path), numerics=numerics)
    a = loaded.args
    assert (a.num_experts, a.num_experts_per_tok, a.moe_routing, a.layer_windows) == (8, 2, "topk_softmax", (16, 0))
    assert a.attn_sinks and a.hidden_act == "swiglu_oai" and (a.swiglu_alpha, a.swiglu_limit) == (1.702, 0.6)
    assert (loaded.model.native_layers is not None) == (numerics == "portable")  # the one-call layers run it
    check_parity(f"tiny-gptoss-{numerics}", loaded, tiny, prompts_for(loaded.tokenizer, a.vocab_size))


@pytest.mark.parametrize("numerics", ["portable", "host"])  # int8 rounds activations: its accuracy is int8's own
def test_gguf_parity_with_transformers(tiny, tiny_gguf, numerics, tmp_path):
    """llama.cpp's converter's file: its config from the file alone (gguf_config's gpt-oss map), every tensor
    under its name (sinks, the router's and the stacked experts' biases), against transformers on the same values."""
    loaded = load_model(tiny_gguf, max_model_len=512, cache_dir=str(tmp_path), numerics=numerics)
    a = loaded.args
    assert (a.num_experts, a.num_experts_per_tok, a.moe_intermediate_size, a.layer_windows) == (8, 2, 32, (16, 0))
    assert (a.swiglu_alpha, a.swiglu_limit, a.attn_sinks, a.qkv_bias, a.o_bias) == (1.702, 7.0, True, True, True)
    check_parity(f"tiny-gptoss-gguf-{numerics}", loaded, tiny_gguf, prompts_for(loaded.tokenizer, a.vocab_size),
                 ref=gguf_reference(tiny))


# A feature switched off in the adapter (ModelArgs fields to override). Softmax-then-top-k *with* renormalization is
# the same function as gpt-oss's top-k-then-softmax (it differs only in rounding), so the broken routing here is
# softmax-then-top-k without it.
BROKEN = {"no-sinks": {"attn_sinks": False}, "no-window": {"layer_windows": (0, 0)},
          "no-clamp": {"swiglu_limit": 1e9}, "alpha-1": {"swiglu_alpha": 1.0},
          "softmax-then-top-k": {"moe_routing": "softmax_topk", "norm_topk_prob": False},
          "top-1": {"num_experts_per_tok": 1}}


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_parity_fails_when_a_feature_is_dropped(tiny, broken, monkeypatch, tmp_path):
    adapter = registry.ARCHITECTURES["GptOssForCausalLM"]
    monkeypatch.setitem(registry.ARCHITECTURES, "GptOssForCausalLM",
                        lambda cfg: dataclasses.replace(adapter(cfg), **BROKEN[broken]))
    loaded = load_model(tiny, max_model_len=512, cache_dir=str(tmp_path), numerics="portable")
    with pytest.raises(AssertionError, match="logprob diff|greedy continuations differ"):
        check_parity(f"tiny-gptoss-{broken}", loaded, tiny, prompts_for(loaded.tokenizer, loaded.args.vocab_size))


def test_the_native_experts_follow_the_biases_of_the_checkpoint(tiny, tmp_path):
    """The router's and experts' biases reach the one-call layers: zeroing one expert's down bias in the model's
    weights changes the one-call block's output for exactly the tokens routed to it."""
    loaded = load_model(tiny, max_model_len=512, cache_dir=str(tmp_path), numerics="portable")
    model = loaded.model
    lw = model.layers[1]
    assert lw.moe is not None and len(lw.moe.biases) == 1 + 2 * 8
    x = torch.randn(40, model.args.hidden_size, generator=torch.Generator().manual_seed(5))
    normed = model._norm(x, lw.post_norm)
    base = model.native_layers.sparse_block(1, normed)
    _, experts = moe.route(model._linear(normed, lw.moe.router, lw.moe.bias("router")), model.spec.moe)
    lw.moe.bias("down", 3).zero_()
    from steadyserve.models.native_forward import build_native_layers
    changed = build_native_layers(model).sparse_block(1, normed)
    uses_3 = (experts == 3).any(dim=-1)
    assert uses_3.any() and (~uses_3).any()
    assert torch.equal(changed[~uses_3], base[~uses_3]) and not torch.equal(changed[uses_3], base[uses_3])


# ---- batch invariance of the engine ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def int8(tiny_gguf, tmp_path_factory):
    loaded = load_model(tiny_gguf, max_model_len=512, cache_dir=str(tmp_path_factory.mktemp("cache")))
    assert loaded.numerics is not None and loaded.numerics.mode == "int8" and loaded.model.native_layers is not None
    gate_up = loaded.model.layers[0].moe.gate_up[0]
    assert [p.format_name for p in gate_up.parts] == ["Q8_0 packed"]  # the experts' grouped int8 path
    engine = engine_for(loaded)
    result = run_selftest(engine)
    assert result.passed, result.detail
    return engine


# test_moe's `mode` (the engine, and the engine with its TEST-ONLY drift) and `bi_engine`, over this module's `int8`;
# then the other architectures' engine checks on them: alone vs batched, prefill vs decode, chunked vs whole prefill,
# the prefix cache (each with its TEST-ONLY break), and 1 vs 2 threads.
from test_moe import bi_engine, mode  # noqa: E402,F401
from test_arch_variants import test_alone_vs_batched, test_chunked_prefill_equals_whole  # noqa: E402,F401
from test_arch_variants import test_prefill_equals_decode, test_prefix_cache_gives_the_uncached_bits  # noqa: E402,F401
from test_int8_engine import test_thread_count_changes_no_bit  # noqa: E402,F401


# ---- the router's order ---------------------------------------------------------------------------------------------

def test_top_k_then_softmax_breaks_ties_by_the_lower_index_in_both_implementations():
    """gpt-oss's order: the k largest logits (ties to the lower index), then the softmax over those k. moe.route and
    the one-call layers' steadyserve::moe_route give the same bits, on exact ties, -inf and NaN rows among random
    ones, alone and batched, at 1 and 2 threads."""
    spec = moe.MoeSpec(num_experts=4, top_k=2, norm_topk_prob=False, expert_size=32, routing="topk_softmax")
    w, e = moe.route(torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0], [2.0, 1.0, 2.0, 2.0]]), spec)
    assert e.tolist() == [[1, 2], [0, 1], [0, 2]]
    assert w.tolist() == [[0.5, 0.5]] * 3
    g = torch.Generator().manual_seed(4)
    logits = torch.cat([torch.randn(100, 32, generator=g) * 3, torch.randint(0, 3, (30, 32), generator=g).float()])
    logits[5, ::4] = float("-inf")
    logits[6, 7] = float("nan")
    threads = torch.get_num_threads()
    try:
        for k in (1, 4, 32):
            spec = moe.MoeSpec(num_experts=32, top_k=k, norm_topk_prob=False, expert_size=32, routing="topk_softmax")
            w_ref, e_ref = moe.route(logits, spec)
            for n in (1, 2):
                torch.set_num_threads(n)
                w, e = torch.ops.steadyserve.moe_route(logits, k, False, True)
                assert torch.equal(e, e_ref) and torch.equal(w.view(torch.int32), w_ref.view(torch.int32)), (k, n)
                w1, e1 = torch.ops.steadyserve.moe_route(logits[40:41].contiguous(), k, False, True)
                assert torch.equal(e1, e_ref[40:41]) and torch.equal(w1, w_ref[40:41])
    finally:
        torch.set_num_threads(threads)


# ---- the clamped SwiGLU ---------------------------------------------------------------------------------------------

def test_the_clamped_swiglu_kernel_is_transformers_gate_and_elementwise():
    """qswiglu_oai_mul against transformers' GptOssExperts._apply_gate (on interleaved columns) within a few ulp,
    with values on both sides of the limits; each row's bits the same alone as among others."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    g = torch.Generator().manual_seed(6)
    gate_up = torch.randn(37, 2 * 48, generator=g) * 4  # limit 3: a third of each half clamped
    ours = torch.ops.steadyserve.qswiglu_oai_mul(gate_up, 1.702, 3.0, -1)
    interleaved = torch.stack([gate_up[:, :48], gate_up[:, 48:]], dim=-1).reshape(37, 96)
    ref = GptOssExperts._apply_gate(type("E", (), {"limit": 3.0, "alpha": 1.702})(), interleaved)
    assert (ours - ref).abs().max() <= 4e-6 * ref.abs().max()
    assert torch.equal(swiglu_oai(gate_up, 1.702, 3.0), ref)  # the host path's expression is transformers' own
    for rows in (slice(0, 1), slice(5, 21)):
        assert torch.equal(torch.ops.steadyserve.qswiglu_oai_mul(gate_up[rows].contiguous(), 1.702, 3.0, -1),
                           ours[rows])


# ---- one real server -------------------------------------------------------------------------------------------------

def test_a_server_answers_chat_with_the_gptoss_gguf(tiny_gguf):
    """The converter's file behind the real server: a chat completion through the file's own template, its
    fingerprint naming the batch-invariant int8 path."""
    with ServerProcess(tiny_gguf, "--max-model-len", "512") as s:
        r = httpx.post(f"http://127.0.0.1:{s.http_port}/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "The quick brown fox"}], "max_tokens": 8, "temperature": 0,
            "logprobs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["finish_reason"] in ("length", "stop") and choice["logprobs"]["content"]
    assert body["system_fingerprint"].endswith("-bi") and "-i" in body["system_fingerprint"]

