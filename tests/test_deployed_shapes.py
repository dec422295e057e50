"""Tiny versions of the 7-8B models teams deploy (benchmarks/deployed_shapes_gguf.py makes the full-size ones):
Llama 3.1 (untied output, llama3 RoPE scaling, grouped-query attention 4:1, and 8:1 as its 70B) and Qwen2.5 (q/k/v
bias, untied output, 7:1, a group that is no power of two).

Each is built by transformers with random weights (testing/tiny_model.py, sizes gqa4/gqa7/gqa8: head_dim 16) and
written as a Q8_0 GGUF by llama.cpp's own converter (testing/llama_converter.py). On the portable path, from the
safetensors, the forward pass has parity with transformers; on the default path, from the GGUF, every matrix the
int8 family reads is packed for it (the untied LM head included, apart from the embedding) and the engine's
invariance checks of test_engine_invariance hold bitwise, and fail against the TEST-ONLY drift.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from steadyserve.models.args import rope_tables
from steadyserve.models.loader import load_model
from steadyserve.testing import build_tiny_model
from steadyserve.testing.drift import install_batch_drift
from steadyserve.testing.llama_converter import convert as llama_cpp_convert
from test_engine_invariance import engine_for, expect, probe_vs_batches, score_vs_generate
from test_models_parity import check_parity, prompts_for

# name: (tiny_model arch, size, query heads per KV head)
SHAPES = {"llama3.1-gqa4": ("llama3", "gqa4", 4), "qwen2.5-gqa7": ("qwen2", "gqa7", 7),
          "llama3.1-gqa8": ("llama3", "gqa8", 8)}


@pytest.fixture(scope="module")
def shapes(models_dir: Path) -> dict[str, tuple[str, str]]:
    """name -> (HF directory, its Q8_0 GGUF written by llama.cpp's converter)."""
    out, jobs = {}, {}
    for name, (arch, size, _) in SHAPES.items():
        d, g = models_dir / f"tiny-{name}", models_dir / f"tiny-{name}.gguf"
        if not d.exists():
            build_tiny_model(d, arch=arch, size=size)
        if not g.exists():
            jobs[d] = g
        out[name] = (str(d), str(g))
    llama_cpp_convert(jobs)
    return out


@pytest.mark.parametrize("name", SHAPES)
def test_parity_with_transformers_on_the_portable_path(shapes, name):
    loaded = load_model(shapes[name][0], max_model_len=512, numerics="portable")
    arch, _, group = SHAPES[name]
    a = loaded.args
    assert a.num_heads == group * a.num_kv_heads and not a.tie_word_embeddings  # the features under test
    assert a.qkv_bias == (arch == "qwen2")
    if arch == "llama3":
        assert a.hf_config.rope_scaling["rope_type"] == "llama3"
    check_parity(f"tiny-{name}", loaded, shapes[name][0], prompts_for(loaded.tokenizer, a.vocab_size))


@pytest.mark.parametrize("name", SHAPES)
def test_the_gguf_gives_the_hf_directorys_model(shapes, name, tmp_path):
    """What the converter wrote reads back as the HF directory's model: heads and KV heads, bias, untied output,
    and RoPE. Llama 3's scaling has no metadata key in a GGUF, only the rope_freqs tensor of per-frequency
    divisors; the tables it gives are the HF config's rope_scaling tables (a 128-position original context here,
    so the scaling bites in the first 512 positions)."""
    hf = load_model(shapes[name][0], max_model_len=512, numerics="portable")
    g = load_model(shapes[name][1], max_model_len=512, numerics="portable", cache_dir=str(tmp_path))
    fields = ("num_heads", "num_kv_heads", "head_dim", "qkv_bias", "tie_word_embeddings", "vocab_size")
    assert [getattr(g.args, f) for f in fields] == [getattr(hf.args, f) for f in fields]
    for ours, theirs in zip(rope_tables(g.args, 512), rope_tables(hf.args, 512)):
        assert torch.allclose(ours, theirs, rtol=0, atol=1e-6), float((ours - theirs).abs().max())


@pytest.fixture(scope="module", params=list(SHAPES))
def default_engine(request, shapes, tmp_path_factory):
    """The GGUF on the default numerics (int8), with the checks' engine settings."""
    loaded = load_model(shapes[request.param][1], max_model_len=512,
                        cache_dir=str(tmp_path_factory.mktemp("cache")))
    return request.param, engine_for(loaded)


def test_every_matrix_and_the_untied_lm_head_run_in_the_int8_family(default_engine):
    name, engine = default_engine
    loaded = engine.loaded
    assert loaded.numerics is not None and loaded.numerics.mode == "int8"
    m = loaded.model
    assert m.lm_head is not m.embed
    for slot, matrix in m.int8_matrices().items():
        assert [p.format_name for p in matrix.parts] == ["Q8_0 packed"], (name, slot)
    assert loaded.args.num_heads == SHAPES[name][2] * loaded.args.num_kv_heads


@pytest.fixture(params=["invariant", "broken"])
def mode(request, default_engine):
    _, engine = default_engine
    if request.param == "broken":
        request.addfinalizer(install_batch_drift(engine))
    return request.param, engine


def test_alone_vs_batched_on_the_default_path(mode):
    name, engine = mode
    expect(name, probe_vs_batches(engine, [3, 17], name=name))


def test_prefill_equals_decode_on_the_default_path(mode):
    name, engine = mode
    expect(name, score_vs_generate(engine, ((5, 12), (40, 8)), name=name))
