"""Gemma 3 and 2, Qwen3, Phi-3, OLMo 2, SmolLM3 and Granite on tiny random models: parity with transformers and
batch invariance.

Each tiny model is built from transformers' own config class with random weights (norm weights
included, so Gemma's (1 + w) shows), saved as safetensors by transformers and as a Q8_0 GGUF by
gguf-py's writer (steadyserve.testing.tiny_gguf, llama.cpp's conventions: Gemma's norms stored as
1 + w). The reference for a GGUF is transformers loading that same file. The tiny Gemma 3 has five
sliding layers (window 16, shorter than the prompts) and one global layer, each type with its own
RoPE base; the tiny Gemma 2 alternates local and global layers and soft-caps scores (2.0) and
logits (3.0) hard enough to matter (its GGUF gets transformers' defaults, 50 and 30); the tiny Phi-3 has fused matrices and a window of 24 on every layer, and a second one
LongRoPE (HF only: transformers reads no LongRoPE from a GGUF); a Gemma 3 with linear RoPE scaling on
its global layers only (as Gemma 3 4B and up) is HF only too, for the same reason. transformers cannot read an
OLMo 2, SmolLM3 or Granite GGUF (it has no config map for them; steadyserve's is models/gguf_config.py), nor a
Qwen3 one whose head_dim is not 128 (it ignores attention.key_length): those files, and Qwen2's, are written by
llama.cpp's own converter (testing/llama_converter.py), not by the project's writer, so that a shared wrong idea of
llama.cpp's format cannot pass; the project's writer saves the HF model with the weights a Q8_0 file stores (each
matrix through Q8_0 and back), transformers on that directory is the reference on the same weights, and
test_llama_cpps_converter_writes_the_tensors_of_the_reference checks that the converter's file holds exactly those. Then the engine invariance checks of test_engine_invariance (and the prefix cache's) run on them, each also
against a TEST-ONLY drift that they must catch, and parity is shown to fail when a Gemma feature
is switched off (the tests can fail).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import test_prefix_cache_engine as prefix_cache
from steadyserve.engine.block_manager import BlockManager
from steadyserve.models import registry
from steadyserve.models import gguf as gguf_mod
from steadyserve.models import gguf_config
from steadyserve.models.loader import load_model
from steadyserve.testing import build_tiny_model
from steadyserve.testing.drift import install_batch_drift
from steadyserve.testing.llama_converter import convert as llama_cpp_convert
from steadyserve.testing.tiny_gguf import write_tiny_gguf
from test_engine_invariance import (PROCESSORS, chunked_vs_whole, engine_for, expect, probe_vs_batches,
                                    score_vs_generate)
from test_models_parity import check_parity, hf_model, prompts_for

ARCHS = ["gemma3", "gemma2", "qwen3", "phi3"]  # safetensors and GGUF; the GGUF's reference: transformers reading it
OWN_GGUF = ["olmo2", "smollm3", "granite", "qwen3-hd48"]  # safetensors and GGUF; the GGUF's reference: its weights, HF
GGUF_ONLY = ["qwen2"]  # GGUF (safetensors parity: test_models_parity); the reference: transformers reading it
CONVERTED = OWN_GGUF + GGUF_ONLY  # GGUF files written by llama.cpp's convert_hf_to_gguf.py, not tiny_gguf.py
HF_ONLY = ["gemma3-linear", "phi3-longrope"]  # transformers reads neither LongRoPE nor linear scaling from a GGUF


def hf_gguf_model(path: str):
    from transformers import AutoModelForCausalLM

    p = Path(path)
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()


def gguf_reference(tiny: dict[str, str], arch: str):
    """transformers on the weights of tiny[arch + "-gguf"]: reading the file, or the HF directory of what it stores."""
    return hf_model(tiny[f"{arch}-stored"]) if arch in OWN_GGUF else hf_gguf_model(tiny[f"{arch}-gguf"])


@pytest.fixture(scope="module")
def tiny(models_dir: Path) -> dict[str, str]:
    """arch -> HF directory, arch + "-gguf" -> the same weights as a Q8_0 GGUF file (CONVERTED: written by
    llama.cpp's converter), for OWN_GGUF arch + "-stored" -> the HF directory of the weights that file stores, and
    for CONVERTED arch + "-own-gguf" -> the project's writer's file of the same model."""
    out, converter_jobs = {}, {}
    for arch in ARCHS + CONVERTED:
        d = models_dir / f"tiny-{arch}"
        if not d.exists():
            build_tiny_model(d, arch=arch)
        out[arch] = str(d)
        g, stored = models_dir / f"tiny-{arch}.gguf", models_dir / f"tiny-{arch}-stored"
        own = models_dir / f"tiny-{arch}-own.gguf" if arch in CONVERTED else g
        if not own.exists():
            write_tiny_gguf(d, own, reference_dir=stored if arch in OWN_GGUF else None)
        if arch in CONVERTED:
            out[f"{arch}-own-gguf"] = str(own)
            if not g.exists():
                converter_jobs[d] = g
        out[f"{arch}-gguf"] = str(g)
        if arch in OWN_GGUF:
            out[f"{arch}-stored"] = str(stored)
    llama_cpp_convert(converter_jobs)
    for arch in HF_ONLY:
        d = models_dir / f"tiny-{arch}"
        if not d.exists():
            build_tiny_model(d, arch=arch)
        out[arch] = str(d)
    return out


@pytest.mark.parametrize("arch", ARCHS + OWN_GGUF + HF_ONLY)
@pytest.mark.parametrize("invariant", [True, False], ids=["invariant", "plain"])
def test_tiny_parity_from_safetensors(tiny, arch, invariant):
    # float32 parity: the portable path (the default int8 path's quantization error is measured, not bounded here)
    loaded = load_model(tiny[arch], batch_invariant=invariant, max_model_len=512,
                        numerics="portable" if invariant else "auto")
    assert loaded.model.native == invariant
    assert (loaded.model.native_layers is not None) == invariant  # every architecture's layers in one native call
    check_parity(f"tiny-{arch}-{'bi' if invariant else 'plain'}", loaded, tiny[arch],
                 prompts_for(loaded.tokenizer, loaded.args.vocab_size))


@pytest.mark.parametrize("arch", ARCHS + CONVERTED)
@pytest.mark.parametrize("numerics", ["portable", "host"])
def test_tiny_parity_from_gguf(tiny, arch, numerics, tmp_path):
    """Portable: the stored Q8_0 blocks; host: the GGUF dequantized to float32 safetensors by transformers
    (Gemma's norms then already have the 1 subtracted, and the HF-directory path adds it back), or for
    OWN_GGUF by gguf-py through steadyserve's own reader, with the config from models/gguf_config.py."""
    path = tiny[f"{arch}-gguf"]
    loaded = load_model(path, max_model_len=512, cache_dir=str(tmp_path), numerics=numerics)
    assert loaded.numerics is not None and loaded.numerics.mode == numerics
    if numerics == "portable":
        assert {p.format_name for lw in loaded.model.layers for p in lw.wqkv.parts} == {"Q8_0"}  # type: ignore[union-attr]
    check_parity(f"tiny-{arch}-gguf-{numerics}", loaded, path, prompts_for(loaded.tokenizer, loaded.args.vocab_size),
                 ref=gguf_reference(tiny, arch))


@pytest.mark.parametrize("arch", CONVERTED)
def test_llama_cpps_converter_writes_the_tensors_of_the_reference(tiny, arch):
    """The GGUF written by llama.cpp's converter holds, tensor by tensor, the names, quantization types and bytes
    that the project's writer stores, so the reference directory made with the writer ("-stored") has the very
    weights the converter's file holds (and tiny_gguf.py's idea of llama.cpp's layout is llama.cpp's)."""
    import gguf

    theirs, ours = (gguf.GGUFReader(tiny[k]) for k in (f"{arch}-gguf", f"{arch}-own-gguf"))
    assert theirs.get_field("general.name").contents() == f"Tiny {arch.replace('-', ' ').title()}"  # the converter's
    assert [(t.name, t.tensor_type.name, t.data.tobytes()) for t in theirs.tensors] == \
        [(t.name, t.tensor_type.name, t.data.tobytes()) for t in ours.tensors]


def as_stored(args):
    """args with every float field rounded to float32, as GGUF metadata stores it (rms_norm_eps 1e-5 is read back
    as 9.99999975e-06, by transformers' GGUF loader too)."""
    import numpy as np

    return dataclasses.replace(args, **{f.name: float(np.float32(getattr(args, f.name)))
                                        for f in dataclasses.fields(args) if isinstance(getattr(args, f.name), float)})


@pytest.mark.parametrize("arch", OWN_GGUF)
def test_own_gguf_config_gives_the_hf_directorys_model(tiny, arch, tmp_path):
    """The config mapped from the GGUF's metadata (llama.cpp's keys) is the HF directory's: every model
    argument (floats as the file stores them, float32), the RoPE tables, and the tokenizer's ids, chat
    prompt and special tokens."""
    from steadyserve.api.protocol import render_chat
    from steadyserve.models.args import rope_tables

    hf = load_model(tiny[arch], max_model_len=512)
    for numerics in ("portable", "host"):
        g = load_model(tiny[f"{arch}-gguf"], max_model_len=512, cache_dir=str(tmp_path), numerics=numerics)
        assert g.args == as_stored(hf.args), (g.args, hf.args)
        assert all(torch.equal(a, b) for a, b in zip(rope_tables(g.args, 64), rope_tables(hf.args, 64)))
    if arch == "qwen3-hd48":
        assert hf.args.head_dim == 48 != hf.args.hidden_size // hf.args.num_heads
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox?"}]
    assert render_chat(g.tokenizer, messages) == render_chat(hf.tokenizer, messages)
    for text in ("The quick brown fox", "Überall façade 🙂 <|im_start|>x"):
        assert g.tokenizer.encode(text) == hf.tokenizer.encode(text)
    assert (g.tokenizer.bos_token_id, g.tokenizer.eos_token_id, g.tokenizer.pad_token_id) == \
        (hf.tokenizer.bos_token_id, hf.tokenizer.eos_token_id, hf.tokenizer.pad_token_id)


def test_tiny_gemma3_has_the_features_under_test(tiny):
    for path in (tiny["gemma3"], tiny["gemma3-gguf"]):
        a = load_model(path, max_model_len=512).args
        assert a.layer_windows == (16, 16, 16, 16, 16, 0), a.layer_windows  # prompts are up to 70 tokens
        assert a.layer_rope[0] == "sliding_attention" and a.layer_rope[5] == "full_attention"
        assert a.qk_norm and a.sandwich_norm and a.norm_offset == 1.0 and a.hidden_act == "gelu_tanh"
        assert a.embed_scale == 8.0 and a.tie_word_embeddings
        assert a.attn_scale != a.head_dim ** -0.5  # query_pre_attn_scalar differs from head_dim
    cfg = load_model(tiny["gemma3"]).args.hf_config
    theta = {k: v["rope_theta"] for k, v in cfg.rope_parameters.items()}
    assert theta["sliding_attention"] != theta["full_attention"], theta


# A feature switched off in the adapter: (model key, architecture, ModelArgs fields to override).
BROKEN = {"gemma3-no-window": ("gemma3-gguf", "Gemma3ForCausalLM", {"layer_windows": (0,) * 6}),
          "gemma3-one-rope-base": ("gemma3", "Gemma3ForCausalLM", {"layer_rope": ("sliding_attention",) * 6}),
          "gemma3-no-embed-scale": ("gemma3", "Gemma3ForCausalLM", {"embed_scale": 1.0}),
          "gemma2-no-attn-softcap": ("gemma2", "Gemma2ForCausalLM", {"attn_softcap": 0.0}),
          "gemma2-no-final-softcap": ("gemma2", "Gemma2ForCausalLM", {"final_softcap": 0.0}),
          "qwen3-no-qk-norm": ("qwen3", "Qwen3ForCausalLM", {"qk_norm": False}),
          "phi3-no-window": ("phi3", "Phi3ForCausalLM", {"sliding_window": 0}),
          "olmo2-no-output-norms": ("olmo2", "Olmo2ForCausalLM", {"sandwich_norm": False}),
          "smollm3-rope-everywhere": ("smollm3", "SmolLM3ForCausalLM", {"layer_use_rope": ()}),
          "granite-no-logit-divisor": ("granite", "GraniteForCausalLM", {"logits_divisor": 1.0})}


# A GGUF reading step switched off: (architecture, module, attribute, value).
BROKEN_GGUF = {"gemma3-gguf-no-norm-shift": ("gemma3", gguf_mod, "_NORM_SHIFTED_ARCHS", set()),
               "granite-gguf-rows-not-unpermuted": ("granite", gguf_mod, "_PERMUTED_ARCHS", {"llama"}),
               "smollm3-gguf-no-nope-step": ("smollm3", gguf_config, "_SMOLLM3_NO_ROPE_STEP", 10**6)}


@pytest.mark.parametrize("broken", sorted(BROKEN) + sorted(BROKEN_GGUF))
def test_parity_fails_when_a_feature_is_dropped(tiny, broken, monkeypatch, tmp_path):
    """The parity check has teeth: each feature, switched off, is caught (and so is reading a GGUF without
    undoing llama.cpp's 1 + w on Gemma's norms or its q/k row interleaving on Granite's, or without its
    hardcoded SmolLM3 no-RoPE step)."""
    ref = None
    if broken in BROKEN:
        key, arch, override = BROKEN[broken]
        adapter = registry.ARCHITECTURES[arch]
        monkeypatch.setitem(registry.ARCHITECTURES, arch, lambda cfg: dataclasses.replace(adapter(cfg), **override))
        if key.endswith("-gguf"):
            ref = gguf_reference(tiny, key.removesuffix("-gguf"))
    else:
        arch, module, attribute, value = BROKEN_GGUF[broken]
        monkeypatch.setattr(module, attribute, value)
        key, ref = f"{arch}-gguf", gguf_reference(tiny, arch)
    path = tiny[key]
    numerics = "host" if broken == "granite-gguf-rows-not-unpermuted" else "portable"  # read_float32 undoes it too
    loaded = load_model(path, max_model_len=512, cache_dir=str(tmp_path), numerics=numerics)
    with pytest.raises(AssertionError, match="logprob diff|greedy continuations differ"):
        check_parity(f"tiny-{broken}", loaded, path, prompts_for(loaded.tokenizer, loaded.args.vocab_size), ref=ref)


# ---- batch invariance: the engine checks of test_engine_invariance, on these blocks ---------------------------

@pytest.fixture(scope="module", params=[f"{a}-{s}" for a in ARCHS + OWN_GGUF for s in ("hf", "gguf")])
def bi_engine(request, tiny, tmp_path_factory):
    arch, source = request.param.rsplit("-", 1)
    path = tiny[arch] if source == "hf" else tiny[f"{arch}-gguf"]
    loaded = load_model(path, max_model_len=512, cache_dir=str(tmp_path_factory.mktemp("cache")))
    assert loaded.model.native
    return engine_for(loaded)


@pytest.fixture(params=["invariant", "broken"])
def mode(request, bi_engine):
    if request.param == "broken":
        restore = install_batch_drift(bi_engine)
        request.addfinalizer(restore)
    return request.param, bi_engine


def test_alone_vs_batched(mode):
    name, engine = mode
    expect(name, probe_vs_batches(engine, [2, 7, 33], name=name))


def test_prefill_equals_decode(mode):
    """score(prompt + completion) gives each completion token the logprob it got while decoded."""
    name, engine = mode
    expect(name, score_vs_generate(engine, ((5, 12), (40, 16)), name=name))


def test_chunked_prefill_equals_whole(mode):
    name, engine = mode
    expect(name, chunked_vs_whole(engine, 7, 4, name))


def test_structured_output_keeps_the_probe_invariant(mode):
    name, engine = mode
    expect(name, probe_vs_batches(engine, [7, 33], name=name, **PROCESSORS["grammar"]))


@pytest.mark.parametrize("broken", [False, True], ids=["invariant", "broken"])
def test_prefix_cache_gives_the_uncached_bits(bi_engine, broken, monkeypatch):
    """test_prefix_cache_engine's shared-prefix case on these blocks; the broken variant hashes a block
    without its prefix (a TEST-ONLY fault) and must be caught."""
    loaded = bi_engine.loaded
    reference = prefix_cache.make_engine(loaded, caching=False)
    if broken:
        monkeypatch.setattr(BlockManager, "_prefix_hashes", prefix_cache._block_only)
    engine = prefix_cache.make_engine(loaded, caching=True)
    prefix_cache.test_shared_prefixes_give_the_uncached_bits(("broken" if broken else "invariant", engine), reference)


@pytest.mark.parametrize("numerics", ["portable", "host"])
def test_qwen3_head_dim_comes_from_key_length(tiny, numerics, monkeypatch, tmp_path):
    """Without taking head_dim from qwen3.attention.key_length (transformers' map ignores it: 128), the head_dim-48
    file does not load (its tensors disagree with the config: models/gguf_check.py); with it, it is at parity
    (test_tiny_parity_from_gguf)."""
    from steadyserve.models.loader import LoadError

    monkeypatch.setattr(gguf_config, "fix_transformers_config", lambda md, cfg, rope_freqs=None: cfg)
    with pytest.raises(LoadError, match=r"has shape \(48,\), expected \(128,\) for head_dim 128 \(the config's"):
        load_model(tiny["qwen3-hd48-gguf"], max_model_len=512, cache_dir=str(tmp_path), numerics=numerics)


def test_phi3_longrope_is_served_up_to_its_original_length(tiny):
    """Past original_max_position_embeddings transformers re-rotates every position with long_factor;
    a table by position cannot, so the context stops there (models/phi3.py)."""
    loaded = load_model(tiny["phi3-longrope"], max_model_len=512)
    assert loaded.max_model_len == 128 and loaded.args.hf_config.max_position_embeddings == 512
    phi3 = load_model(tiny["phi3"], max_model_len=512)
    assert phi3.args.sliding_window == 24 and phi3.max_model_len == 512


def test_tiny_variants_have_the_features_under_test(tiny):
    lin = load_model(tiny["gemma3-linear"]).args.hf_config.rope_parameters
    assert lin["full_attention"]["rope_type"] == "linear" and lin["sliding_attention"]["rope_type"] == "default"
    g2 = load_model(tiny["gemma2"]).args
    assert (g2.attn_softcap, g2.final_softcap, g2.layer_windows) == (2.0, 3.0, (16, 0, 16, 0))
    assert not g2.qk_norm and g2.sandwich_norm and g2.norm_offset == 1.0
    olmo = load_model(tiny["olmo2"]).args
    assert not olmo.pre_norm and olmo.sandwich_norm and olmo.qk_norm and not olmo.qk_norm_per_head
    assert load_model(tiny["smollm3"]).args.layer_use_rope == (True, True, True, False)
    g = load_model(tiny["granite"]).args
    assert (g.embed_scale, g.residual_scale, g.attn_scale, g.logits_divisor) == (4.0, 0.5, 0.2, 2.5)


@pytest.mark.parametrize("arch", ARCHS + GGUF_ONLY)
def test_gguf_chat_template_renders_as_transformers_renders_it(tiny, arch, tmp_path):
    """The template, BOS/EOS and special tokens come from the GGUF's metadata through transformers."""
    from transformers import AutoTokenizer

    from steadyserve.api.protocol import render_chat

    path = Path(tiny[f"{arch}-gguf"])
    loaded = load_model(str(path), max_model_len=512, cache_dir=str(tmp_path))
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox?"}]
    want = ref(ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]
    assert render_chat(loaded.tokenizer, messages) == list(want)
    assert (loaded.tokenizer.bos_token_id, loaded.tokenizer.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    assert loaded.tokenizer.encode("The quick brown fox") == ref.encode("The quick brown fox")


def test_an_unsupported_architecture_is_refused_with_its_name_and_the_supported_list():
    from transformers import GPT2Config

    cfg = GPT2Config(architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"unsupported architecture \['GPT2LMHeadModel'\]; supported: ") as e:
        registry.model_args(cfg)
    assert all(name in str(e.value) for name in registry.ARCHITECTURES), str(e.value)
