"""Qwen3-MoE (models/moe.py, models/qwen3moe.py) on a tiny random model: parity with transformers, batch invariance of
the default int8 path with the expert choice included, the router's ties, rows independent of their expert group,
the memory the experts take, malformed files, and one real server.

The model: transformers' Qwen3MoeForCausalLM from a config with a fixed seed (2 layers, hidden 64, 8 experts of width
32, top-2 renormalized, as Qwen3-30B-A3B routes), and the same model as a Q8_0 GGUF written by llama.cpp's own
converter (testing/llama_converter.py). The GGUF's reference is transformers reading that file (its own tensor map
for qwen3moe, independent of steadyserve's), with the expert width its GGUF map drops put back. A second model,
"mixed", has a dense first layer (mlp_only_layers) and top-3 of 4 experts without renormalization (HF only: a GGUF
cannot say either). Every invariance check also runs against a TEST-ONLY break that it must catch. Also here: the
host path's invariance where its self-test confirms it, the packed-weight cache of the experts, and `--speculation
auto` off for a sparse model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx
import pytest
import torch

from steadyserve.engine.selftest import run_selftest
from steadyserve.kernels import load
from steadyserve.kernels.quant import QMatrix, QWeight
from steadyserve.memory import tensor_bytes
from steadyserve.models import gguf_config, moe, registry
from steadyserve.models.loader import LoadError, load_model
from steadyserve.models.native_forward import build_native_layers
from steadyserve.testing import build_tiny_model
from steadyserve.testing.drift import install_batch_drift
from steadyserve.testing.gguf_layout import layout, patch
from steadyserve.testing.llama_converter import convert as llama_cpp_convert
from steadyserve.testing.server import ServerProcess
from test_engine_invariance import engine_for, probe_vs_batches, score_vs_generate
from test_models_parity import check_parity, hf_model, prompts_for

pytestmark = pytest.mark.skipif(not load().available, reason="native kernels not built")


@pytest.fixture(scope="module")
def tiny(models_dir: Path) -> dict[str, str]:
    out = {}
    for arch in ("qwen3moe", "qwen3moe-mixed"):
        d = models_dir / f"tiny-{arch}"
        if not d.exists():
            build_tiny_model(d, arch=arch)
        out[arch] = str(d)
    g = models_dir / "tiny-qwen3moe.gguf"
    if not g.exists():
        llama_cpp_convert({models_dir / "tiny-qwen3moe": g})
    out["gguf"] = str(g)
    return out


def gguf_reference(path: str):
    """transformers reading the GGUF, with moe_intermediate_size from qwen3moe.expert_feed_forward_length (its map
    drops it: models/gguf_config.fix_transformers_config)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    p = Path(path)
    cfg = AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)
    cfg.moe_intermediate_size = 32
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, config=cfg,
                                                dtype=torch.float32).eval()


# ---- parity with transformers ------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["hf-portable", "gguf-portable", "gguf-host", "mixed-portable"])
def test_parity_with_transformers(tiny, case, tmp_path):
    source, numerics = case.split("-")
    path = tiny["gguf"] if source == "gguf" else tiny["qwen3moe-mixed" if source == "mixed" else "qwen3moe"]
    loaded = load_model(path, max_model_len=512, cache_dir=str(tmp_path), numerics=numerics)
    a = loaded.args
    assert (a.num_experts, a.num_experts_per_tok, a.norm_topk_prob) == ((4, 3, False) if source == "mixed"
                                                                         else (8, 2, True))
    assert a.layer_moe == ((False, True) if source == "mixed" else (True, True))
    check_parity(f"tiny-qwen3moe-{case}", loaded, path, prompts_for(loaded.tokenizer, a.vocab_size),
                 ref=gguf_reference(path) if source == "gguf" else None)


# A routing feature switched off in the adapter: (model key, ModelArgs fields to override).
BROKEN = {"no-renormalization": ("qwen3moe", {"norm_topk_prob": False}),
          "top-1": ("qwen3moe", {"num_experts_per_tok": 1}),
          "mixed-renormalized": ("qwen3moe-mixed", {"norm_topk_prob": True})}


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_parity_fails_when_routing_is_changed(tiny, broken, monkeypatch):
    key, override = BROKEN[broken]
    adapter = registry.ARCHITECTURES["Qwen3MoeForCausalLM"]
    monkeypatch.setitem(registry.ARCHITECTURES, "Qwen3MoeForCausalLM",
                        lambda cfg: dataclasses.replace(adapter(cfg), **override))
    loaded = load_model(tiny[key], max_model_len=512, numerics="portable")
    with pytest.raises(AssertionError, match="logprob diff|greedy continuations differ"):
        check_parity(f"tiny-{broken}", loaded, tiny[key], prompts_for(loaded.tokenizer, loaded.args.vocab_size))


def test_the_gguf_expert_width_comes_from_its_metadata(tiny, monkeypatch, tmp_path):
    """Without qwen3moe.expert_feed_forward_length (transformers' map drops it: 768), the file does not load, and
    the error names the tensor, the shape and the key."""
    monkeypatch.setattr(gguf_config, "fix_transformers_config", lambda md, cfg, rope_freqs=None: cfg)
    with pytest.raises(LoadError, match=r"ffn_down_exps.weight' has shape \(32, 64, 8\), expected \(768, 64, 8\) "
                                        r"for .* moe_intermediate_size 768 \(the config's: no key in the file"):
        load_model(tiny["gguf"], max_model_len=512, cache_dir=str(tmp_path), numerics="portable")


# ---- batch invariance on the default path (int8) -------------------------------------------------------------------

@pytest.fixture(scope="module")
def int8(tiny, tmp_path_factory):
    loaded = load_model(tiny["gguf"], max_model_len=512, cache_dir=str(tmp_path_factory.mktemp("cache")))
    assert loaded.numerics is not None and loaded.numerics.mode == "int8"
    engine = engine_for(loaded)
    result = run_selftest(engine)
    assert result.passed, result.detail
    return engine


@pytest.fixture(params=["invariant", "broken"])
def mode(request, int8):
    if request.param == "broken":
        request.addfinalizer(install_batch_drift(int8))
    return request.param, int8


@pytest.fixture(scope="module")
def bi_engine(int8):
    return int8


# The engine checks of the other architectures and of the int8 path, collected here on this module's `mode`, `int8`
# and `bi_engine` fixtures: alone vs batched, prefill vs decode, chunked vs whole prefill, a grammar, the prefix cache
# (each with its TEST-ONLY break), and 1 vs 2 threads.
from test_arch_variants import test_alone_vs_batched, test_chunked_prefill_equals_whole  # noqa: E402,F401
from test_arch_variants import test_prefill_equals_decode, test_prefix_cache_gives_the_uncached_bits  # noqa: E402,F401
from test_arch_variants import test_structured_output_keeps_the_probe_invariant  # noqa: E402,F401
from test_int8_engine import test_thread_count_changes_no_bit  # noqa: E402,F401


def test_the_packed_cache_holds_the_experts(paths, paths_cache, tiny):
    """The int8 panels of every expert are written to the packed-weight cache at the first load, and the next load
    maps them from it (views of the cache file: no repacking), with the same bits."""
    import json
    import struct

    (q8p,) = (paths_cache / "packed").glob("tiny-qwen3moe-*.q8p")
    raw = q8p.read_bytes()
    n = struct.unpack("<Q", raw[-16:-8])[0]
    slots = json.loads(raw[-16 - n:-16])["slots"]
    assert {f"layers.{i}.experts.{e}.{m}" for i in range(2) for e in range(8) for m in ("gate_up", "down")} <= set(slots)
    again = load_model(tiny["gguf"], max_model_len=512, cache_dir=str(paths_cache), numerics="int8")
    mapping = again.keepalive[1]  # repack.RepackResult.keepalive: the cache file's mapping, None when repacked
    assert mapping is not None
    lo, hi = mapping.ctypes.data, mapping.ctypes.data + mapping.size
    lw, first = again.model.layers[1], paths["int8"].layers[1]
    assert all(lo <= p.data.data_ptr() < hi for m in lw.moe.gate_up + lw.moe.down for p in m.parts)
    x = torch.randn(9, again.args.hidden_size, generator=torch.Generator().manual_seed(1))
    assert torch.equal(_mlp_out(again.model, lw, x), _mlp_out(paths["int8"], first, x))


def test_sparse_layers_follow_the_config():
    """transformers' rule: a layer is sparse unless in mlp_only_layers, and only every decoder_sparse_step-th."""
    from transformers import Qwen3MoeConfig

    from steadyserve.models.qwen3moe import qwen3moe_args

    base = dict(vocab_size=64, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    assert qwen3moe_args(Qwen3MoeConfig(**base)).layer_moe == (True,) * 6
    assert qwen3moe_args(Qwen3MoeConfig(decoder_sparse_step=2, **base)).layer_moe == (False, True) * 3
    assert qwen3moe_args(Qwen3MoeConfig(mlp_only_layers=[0, 5], decoder_sparse_step=1, **base)).layer_moe == \
        (False, True, True, True, True, False)
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(5\) must be 1 to num_experts \(4\)"):
        qwen3moe_args(Qwen3MoeConfig(**{**base, "num_experts_per_tok": 5}))


def test_the_host_path_keeps_what_its_self_test_confirms(tiny, tmp_path):
    """--numerics host (MKL, invariance observed): the experts run in counts verified on their own probe (the expert
    tiler), and where the self-test confirms invariance, a probe is the same alone and batched, scored and decoded."""
    loaded = load_model(tiny["gguf"], max_model_len=512, cache_dir=str(tmp_path), numerics="host", row_tile=64)
    engine = engine_for(loaded)
    result = run_selftest(engine)
    assert result.passed, result.detail  # a host that does not confirm it serves -nbi; none seen so far
    assert loaded.model.expert_tiler.tiles[-1] == 64 and len(loaded.model.expert_tiler.tiles) > 1
    diffs = {**probe_vs_batches(engine, [2, 33]), **score_vs_generate(engine, ((40, 16),))}
    assert all(v == 0.0 for v in diffs.values()), diffs


def test_auto_speculation_is_off_for_a_sparse_model(int8):
    """A draft row reads its own experts: not the cheap row the speculator's allocation assumes (engine._cheap_rows)."""
    assert int8.speculator.cheap_rows == 1 and not int8.speculator.enabled


def test_experts_are_packed_once_and_counted(int8):
    """Every expert runs on int8 panels, none keeps its GGUF view beside them, the router stays float32 (F32 rows),
    and the memory plan's weight bytes include every panel."""
    model, loaded = int8.loaded.model, int8.loaded
    panels = 0
    for lw in model.layers:
        assert lw.moe is not None and lw.w_gate_up is None and lw.w_down is None
        assert [p.format_name for p in lw.moe.router.parts] == ["F32"]
        for m in lw.moe.gate_up + lw.moe.down:
            assert [p.format_name for p in m.parts] == ["Q8_0 packed"]  # gate|up joined: one part per expert
            panels += m.nbytes
    assert panels == 2 * 8 * 3 * 32 * 64 // 32 * 34  # layers x experts x (gate, up, down) x Q8_0 bytes
    saved = [lw.moe for lw in model.layers]
    try:  # the same model without its sparse blocks: the weight bytes the plan counts beside them
        for lw in model.layers:
            lw.moe = None
        without = tensor_bytes(model)
    finally:
        for lw, m in zip(model.layers, saved):
            lw.moe = m
    assert loaded.weights_bytes - without == panels + sum(lw.moe.router.nbytes for lw in model.layers)


# ---- the routing: ties and independent rows, on every path ---------------------------------------------------------

@pytest.fixture(scope="module")
def paths_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("paths")


@pytest.fixture(scope="module")
def paths(tiny, paths_cache):
    return {n: load_model(tiny["gguf"], max_model_len=512, cache_dir=str(paths_cache), numerics=n).model
            for n in ("portable", "int8", "host")}


def _mlp_out(model, lw, x: torch.Tensor) -> torch.Tensor:
    """The layer's sparse block on rows x (T, hidden), through the model's own per-op code (attention output 0)."""
    s = model.spec
    return model._out_mlp(lw, x, torch.zeros(x.shape[0], s.num_heads, s.head_dim))


def _one_call_block(model, i: int, x: torch.Tensor) -> torch.Tensor:
    """Layer i's sparse block on rows x (T, hidden) as the one-call layers run it (kernels/csrc/moe.cpp), built from
    the model's weights as they are now; its input normed as _out_mlp norms it."""
    lw = model.layers[i]
    return build_native_layers(model).sparse_block(i, model._norm(x, lw.post_norm))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


_ROUTE = moe.route


def _high_index_route(logits, spec):
    """TEST-ONLY broken routing: the same softmax and top-k, ties to the higher index."""
    w, e = _ROUTE(logits.flip(-1), spec)
    return w, spec.num_experts - 1 - e


def test_exp_fixed_is_exp_and_elementwise():
    """The routing's exp: within 2 ulp of float64's exp over its domain, and each element's bits the same whatever
    tensor it sits in (PyTorch's own exp takes a vector body or a scalar tail by position)."""
    x = torch.linspace(moe.EXP_LOW, 0.0, 100_003, dtype=torch.float32)
    y = moe.exp_fixed(x)
    rel = ((y.double() - x.double().exp()) / x.double().exp()).abs().max().item()
    assert rel < 2 * 2.0 ** -23, rel
    assert all(torch.equal(moe.exp_fixed(x[i:i + n]), y[i:i + n]) for i, n in ((0, 1), (5, 3), (17, 16), (99, 33)))


def test_route_breaks_ties_by_the_lower_index():
    spec = moe.MoeSpec(num_experts=4, top_k=2, norm_topk_prob=True, expert_size=32)
    w, e = moe.route(torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, 0.0, 0.0, 0.0], [2.0, 1.0, 2.0, 2.0]]), spec)
    assert e.tolist() == [[1, 2], [0, 1], [0, 2]]
    assert w[:, 0].tolist() == w[:, 1].tolist() == [0.5, 0.5, 0.5]


@pytest.mark.parametrize("numerics", ["portable", "int8", "host"])
@pytest.mark.parametrize("routing", ["lower-index", "broken"])
def test_a_router_tie_goes_to_the_lower_index(paths, numerics, routing, monkeypatch):
    """Router rows 3 and 5 equal (so their logits are equal, bit for bit), row 0 twice them, the rest zero: where
    the shared logit is positive, expert 0 is first and 3 and 5 tie for the second place, which the lower index,
    3, takes; elsewhere the zero rows tie and 1 and 2 take both. So expert 5 is never used: changing its weights
    changes no bit, while changing expert 3's does. The broken routing (ties to the higher index) is caught."""
    model = paths[numerics]
    lw = model.layers[0]
    g = torch.Generator().manual_seed(3)
    v = torch.randn(model.args.hidden_size, generator=g)
    rows = torch.zeros(8, model.args.hidden_size)
    rows[0], rows[3], rows[5] = 2 * v, v, v
    x = torch.randn(64, model.args.hidden_size, generator=g)
    saved = dataclasses.replace(lw.moe, gate_up=list(lw.moe.gate_up), down=list(lw.moe.down))
    if routing == "broken":
        monkeypatch.setattr(moe, "route", _high_index_route)
    # The per-op block, and on the native paths the one-call layers' (whose routing is moe.cpp's, not moe.route)
    paths = [lambda: _mlp_out(model, lw, x)] + ([lambda: _one_call_block(model, 0, x)] if model.native else [])
    try:
        lw.moe.router = QMatrix([QWeight.from_tensor(rows)]) if model.native else rows
        base = [run() for run in paths]
        lw.moe.gate_up[5], lw.moe.down[5] = saved.gate_up[6], saved.down[6]
        five_changed = [run() for run in paths]
        lw.moe.gate_up[3], lw.moe.down[3] = saved.gate_up[6], saved.down[6]
        three_changed = [run() for run in paths]
    finally:
        lw.moe = saved
    for path, (b, five, three) in enumerate(zip(base, five_changed, three_changed)):
        assert not torch.equal(b, three), path  # expert 3 is used: the construction has teeth
        if routing == "lower-index" or path == 1:  # the broken routing is moe.py's: the one call keeps its own
            assert torch.equal(b, five), path
        else:
            assert not torch.equal(b, five)


def _tie_logits() -> torch.Tensor:
    """Router logits (T, 128) with every case the routing must decide as moe.py does: random rows, rows of many
    exact ties (a few distinct values), a constant row, -inf entries, a row with a NaN, a row all NaN, and rows far
    below and above the exp's domain after the max is taken."""
    g = torch.Generator().manual_seed(11)
    rand = torch.randn(200, 128, generator=g) * 4
    ties = torch.randint(0, 3, (40, 128), generator=g).float()
    special = torch.randn(6, 128, generator=g)
    special[0] = 0.25
    special[1, ::3] = float("-inf")
    special[2, 17] = float("nan")
    special[3] = float("nan")
    special[4, 5] = 200.0
    special[5] *= 1e30
    return torch.cat([rand, ties, special])


@pytest.mark.parametrize("top_k,norm", [(8, True), (8, False), (1, True), (3, False), (128, True)])
def test_the_one_call_routing_is_moe_py_routing(top_k, norm):
    """steadyserve::moe_route (what the one-call layers route with) gives moe.route's weights and experts bit for
    bit, on every row _tie_logits makes, alone or among the others, at 1 and at 2 threads."""
    logits = _tie_logits()
    spec = moe.MoeSpec(num_experts=128, top_k=top_k, norm_topk_prob=norm, expert_size=32)
    w_ref, e_ref = moe.route(logits, spec)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            w, e = torch.ops.steadyserve.moe_route(logits, top_k, norm)
            assert torch.equal(e, e_ref) and torch.equal(_bits(w), _bits(w_ref)), n
            for i in (0, 200, 240, 243, 245):
                w1, e1 = torch.ops.steadyserve.moe_route(logits[i:i + 1].contiguous(), top_k, norm)
                assert torch.equal(e1[0], e_ref[i]) and torch.equal(_bits(w1[0]), _bits(w_ref[i])), i
    finally:
        torch.set_num_threads(threads)
    assert all(logits[i].unique().numel() <= 3 for i in range(200, 240))  # the tie rows do tie


def test_the_one_call_routing_refuses_a_bad_top_k():
    with pytest.raises(RuntimeError, match=r"moe_route: top_k = 9 is not in \[1, E = 8\]"):
        torch.ops.steadyserve.moe_route(torch.zeros(2, 8), 9, True)


@pytest.mark.parametrize("numerics", ["portable", "int8"])
@pytest.mark.parametrize("top_k", [2, 4])
def test_the_one_call_block_is_the_per_op_block(paths, numerics, top_k):
    """Both sparse layers through NativeLayers.sparse_block against moe.moe_block on the same normed rows: the same
    bits for 1 row and for 300 rows (experts' groups of every size; at top-4, 1,200 pairs: two of moe.cpp's slices
    of 1,024, one expert's rows cut between them). At top-4 (the model's 2 widened for both) a
    token's terms add differently by rank than by expert index, so the order of the adds is checked too; on int8
    the experts run grouped (matmul_packed_groups), on portable one at a time."""
    model = paths[numerics]
    spec = dataclasses.replace(model.spec, moe=dataclasses.replace(model.spec.moe, top_k=top_k))
    layers = build_native_layers(model, spec)
    x = torch.randn(300, model.args.hidden_size, generator=torch.Generator().manual_seed(8))
    for i, lw in enumerate(model.layers):
        pre = model._norm(x, lw.post_norm)
        ref = moe.moe_block(pre, lw.moe, spec.moe, lambda v, w: model._linear(v, w, None), model._gated_act,
                            model.expert_tiler)
        assert torch.equal(_bits(layers.sparse_block(i, pre)), _bits(ref)), i
        assert torch.equal(_bits(layers.sparse_block(i, pre[3:4])), _bits(ref[3:4])), i


def test_the_one_call_layers_match_the_per_op_path_on_the_int8_gguf(tiny):
    """Prefill and decode, chunked and whole, 1 and 2 threads: the served logprobs, tokens and KV cache of the
    tiny GGUF on its default (int8) path are the per-op path's (test_native_forward's check; its dropped-feature
    tests catch a changed routing there)."""
    from test_native_forward import _check_bitwise

    _check_bitwise(tiny["gguf"])


@pytest.mark.parametrize("numerics", ["portable", "int8"])
@pytest.mark.parametrize("grouping", ["kernels", "broken"])
def test_a_rows_expert_output_does_not_depend_on_its_group(paths, numerics, grouping, monkeypatch):
    """Each row of the sparse block alone equals, bitwise, the same row computed with 39 others (which share its
    experts in groups of every size), and every expert's rows alone equal them in any group. The broken variant
    (TEST-ONLY) makes an expert's output depend on its group's size, and is caught."""
    model = paths[numerics]
    lw = model.layers[1]
    if grouping == "broken":
        monkeypatch.setattr(model, "expert_tiler", lambda fn, rows: fn(rows) + rows.shape[0] * 2.0 ** -16)
    x = torch.randn(40, model.args.hidden_size, generator=torch.Generator().manual_seed(5))
    together = _mlp_out(model, lw, x)
    alone = torch.cat([_mlp_out(model, lw, x[i:i + 1]) for i in range(x.shape[0])])
    fn = (lambda xe: model._linear(model._gated_act(model._linear(xe, lw.moe.gate_up[4], None)),
                                   lw.moe.down[4], None))
    group = model.expert_tiler(fn, x)
    singles = torch.cat([model.expert_tiler(fn, x[i:i + 1]) for i in range(x.shape[0])])
    if grouping == "kernels":
        assert torch.equal(together, alone) and torch.equal(group, singles)
    else:
        assert not torch.equal(together, alone)


# ---- malformed files ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["expert_count", "expert_used_count"])
def test_a_damaged_moe_gguf_is_refused_by_name(tiny, damage, tmp_path):
    raw = Path(tiny["gguf"]).read_bytes()
    lay = layout(raw)
    value, needle = {"expert_count": (6, r"ffn_down_exps.weight' has shape \(32, 64, 8\), expected \(32, 64, 6\) "
                                         r"for .* num_experts 6 from 'qwen3moe.expert_count'"),
                     "expert_used_count": (9, r"'qwen3moe.expert_used_count' is 9: more than 'qwen3moe.expert_count'"
                                              r" 8")}[damage]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(patch(raw, lay.kvs[f"qwen3moe.{damage}"].value, value))  # type: ignore[arg-type]
    with pytest.raises(LoadError, match=needle):
        load_model(str(bad), max_model_len=512, cache_dir=str(tmp_path / "cache"))
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())


def test_a_missing_expert_tensor_is_named(tiny):
    from steadyserve.models.gguf_check import check_tensors
    from steadyserve.models.gguf_config import GgufConfigError
    from steadyserve.models.gguf_file import read_gguf

    args = load_model(tiny["qwen3moe"], max_model_len=512).args
    f = read_gguf(tiny["gguf"])
    f.tensors = [t for t in f.tensors if t.name != "blk.1.ffn_up_exps.weight"]
    with pytest.raises(GgufConfigError, match=r"tensor 'blk.1.ffn_up_exps.weight' is missing: a qwen3moe model of 2 "
                                              r"layers"):
        check_tensors(f, args, native=True)


@pytest.mark.parametrize("key", ["expert_count", "expert_used_count", "expert_feed_forward_length"])
def test_a_missing_expert_key_is_named(tiny, key):
    from steadyserve.models.gguf_check import check_metadata
    from steadyserve.models.gguf_config import GgufConfigError
    from steadyserve.models.gguf_file import read_gguf

    f = read_gguf(tiny["gguf"])
    check_metadata(f.metadata, "qwen3moe", len(f.tensors))  # the file as written passes
    md = {k: v for k, v in f.metadata.items() if k != f"qwen3moe.{key}"}
    with pytest.raises(GgufConfigError, match=rf"metadata key 'qwen3moe.{key}' is missing: a qwen3moe file states"):
        check_metadata(md, "qwen3moe", len(f.tensors))


# ---- one real server -------------------------------------------------------------------------------------------------

def test_a_server_answers_with_the_moe_gguf(tiny):
    with ServerProcess(tiny["gguf"], "--max-model-len", "512") as s:
        r = httpx.post(f"http://127.0.0.1:{s.http_port}/v1/completions", timeout=60, json={
            "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0, "logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["logprobs"]["tokens"]) == 8
    assert body["system_fingerprint"].endswith("-bi") and "-i" in body["system_fingerprint"]


def test_a_lone_row_adds_its_experts_as_a_batch_does():
    """moe_block on one row (a lone stream's decode step) against the same row among others: bitwise equal, with 4
    of 8 experts per token so the order of the adds matters (by expert index, ascending; two terms, as the tiny
    models' top-2, add the same either way). Row-wise float matmuls stand in for the path's. (A one-row shortcut
    that adds its experts by rank instead fails it.)"""
    g = torch.Generator().manual_seed(7)
    hidden, width, e = 16, 8, 8
    spec = moe.MoeSpec(num_experts=e, top_k=4, norm_topk_prob=True, expert_size=width)
    w = moe.MoeWeights(router=torch.randn(e, hidden, generator=g),
                       gate_up=[torch.randn(2 * width, hidden, generator=g) for _ in range(e)],
                       down=[torch.randn(hidden, width, generator=g) for _ in range(e)])

    def linear(v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:  # each row alone, whatever the row count
        return torch.stack([(r * m).sum(-1) for r in v])

    def act(gu: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(gu[:, :width]) * gu[:, width:]

    x = torch.randn(5, hidden, generator=g)
    batched = moe.moe_block(x, w, spec, linear, act, lambda fn, rows: fn(rows))
    for i in range(5):
        alone = moe.moe_block(x[i:i + 1], w, spec, linear, act, lambda fn, rows: fn(rows))
        assert torch.equal(alone[0], batched[i]), i
