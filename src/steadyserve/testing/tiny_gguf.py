"""Write a tiny Hugging Face model (tiny_model.py) as a GGUF file, the way llama.cpp's converter does.

gguf-py's own writer and tensor-name map do the work; what is llama.cpp's convention, not gguf-py's,
is spelled out here: the q/k rows of Llama and of its converter's subclasses (SmolLM3, Granite) are
permuted for their RoPE layout, Gemma's RMSNorm weights are stored as 1 + w, and the metadata keys
are the ones llama.cpp's convert_hf_to_gguf.py writes (TextModel.set_gguf_parameters: key_length only
where the config has a head_dim; LlamaModel adds vocab_size and rope.dimension_count; GraniteModel
drops head_dim and writes its four multipliers as embedding_scale, residual_scale, attention.scale
and logit_scale; SmolLM3 and OLMo 2 add nothing). Matrices are stored as Q8_0 (their exact
dequantized values are what both transformers and steadyserve then compute with), vectors as F32.
The tokenizer is the tiny byte-level BPE, as a "gpt2" vocabulary.

For the architectures transformers cannot read from a GGUF, `reference_dir` receives the HF model
with the weights the file holds (each matrix through Q8_0 and back, by gguf-py): transformers on
that directory is the reference on the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# HF architecture -> GGUF architecture name (gguf.MODEL_ARCH_NAMES), for those this writer knows.
GGUF_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
             "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3",
             "Olmo2ForCausalLM": "olmo2", "SmolLM3ForCausalLM": "smollm3", "GraniteForCausalLM": "granite"}
_LLAMA_LINEAGE = {"llama", "smollm3", "granite"}  # converter classes deriving LlamaModel: q/k rows permuted


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: rows (n_head, 2, dim) -> (n_head, dim, 2)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(hf_dir: str | Path, out: str | Path, quant: str = "Q8_0",
                    reference_dir: str | Path | None = None, pooling_type: int | None = None) -> Path:
    """Convert the model in hf_dir to the GGUF file `out` and return its path; with reference_dir, also
    write there the HF model with the weights as the file stores them (see the module docstring); with
    pooling_type, the `<arch>.pooling_type` key (llama.cpp's enum: 1 mean, 3 last) an embedding model has."""
    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    hf_dir, out = Path(hf_dir), Path(out)
    cfg = AutoConfig.from_pretrained(str(hf_dir))
    arch = GGUF_ARCH[cfg.architectures[0]]
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, cfg.num_hidden_layers)

    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"tiny-{arch}")
    _add_hparams(w, cfg, json.loads((hf_dir / "config.json").read_text()), arch)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if quant == "Q8_0" else gguf.LlamaFileType.ALL_F32)
    if pooling_type is not None:
        w.add_pooling_type(gguf.PoolingType(pooling_type))
    _add_tokenizer(w, hf_dir)

    qtype = gguf.GGMLQuantizationType[quant]
    stored: dict[str, np.ndarray] = {}  # HF name -> the values the file holds, in HF layout
    for hf, t in load_file(str(hf_dir / "model.safetensors")).items():
        stored[hf] = t
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, _, kind = hf.rpartition(".")
        name = names.get_name(base)
        if name is None:
            raise ValueError(f"{hf}: no GGUF name for {arch}")
        t = t.astype(np.float32)
        if t.ndim == 2 and t.shape[1] % 32 == 0:  # row-wise blocks: the permutation below moves whole rows
            stored[hf] = gguf.quants.dequantize(gguf.quants.quantize(t, qtype), qtype).astype(np.float32)
        if arch in _LLAMA_LINEAGE and name.endswith(("attn_q", "attn_k")):
            t = _permute(t, cfg.num_attention_heads if name.endswith("attn_q") else cfg.num_key_value_heads)
        if arch in ("gemma2", "gemma3") and name.endswith("norm"):
            t = t + np.float32(1.0)  # llama.cpp stores Gemma's norms as 1 + w
        if t.ndim == 2 and t.shape[1] % 32 == 0:
            w.add_tensor(f"{name}.{kind}", gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(f"{name}.{kind}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if reference_dir is not None:
        _write_reference(hf_dir, Path(reference_dir), stored)
    return out


def _add_hparams(w, cfg, raw: dict, arch: str) -> None:
    """The model's hyper-parameters under the keys llama.cpp's converter writes for `arch`."""
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(float((rope["full_attention"] if "full_attention" in rope else rope)["rope_theta"]))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if arch in ("olmo2", "smollm3", "granite"):  # as their converter classes, key by key
        if "head_dim" in raw and arch != "granite":  # TextModel: only a stated head_dim; Granite pops it
            w.add_key_length(raw["head_dim"])
            w.add_value_length(raw["head_dim"])
        if arch in _LLAMA_LINEAGE:  # LlamaModel.set_gguf_parameters
            w.add_vocab_size(cfg.vocab_size)
            w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads if arch == "granite" else head_dim)
        if arch == "granite":  # each only when nonzero, as GraniteModel writes them
            for value, add in ((cfg.attention_multiplier, w.add_attention_scale),
                               (cfg.embedding_multiplier, w.add_embedding_scale),
                               (cfg.residual_multiplier, w.add_residual_scale),
                               (cfg.logits_scaling, w.add_logit_scale)):
                if value:
                    add(float(value))
        return
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(cfg.sliding_window)


def _write_reference(hf_dir: Path, out: Path, stored: dict[str, np.ndarray]) -> None:
    """hf_dir's files, with model.safetensors holding the values the GGUF stores."""
    import shutil

    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in hf_dir.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    save_file({k: np.ascontiguousarray(v) for k, v in stored.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})


def _add_tokenizer(w, hf_dir: Path) -> None:
    """The byte-level BPE tokenizer of tiny_model.py as llama.cpp's "gpt2" vocabulary."""
    tj = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = dict(tj["model"]["vocab"])
    for added in tj.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [""] * (max(vocab.values()) + 1)
    for tok, i in vocab.items():
        tokens[i] = tok
    specials = {a["id"] for a in tj.get("added_tokens", []) if a.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    tc = json.loads((hf_dir / "tokenizer_config.json").read_text())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in specials else 1 for i in range(len(tokens))])
    w.add_token_merges(merges)
    for key, add in (("bos_token", w.add_bos_token_id), ("eos_token", w.add_eos_token_id),
                     ("pad_token", w.add_pad_token_id)):
        if tc.get(key) in vocab:
            add(vocab[tc[key]])
    w.add_add_bos_token(False)
    template = hf_dir / "chat_template.jinja"
    chat = template.read_text() if template.is_file() else tc.get("chat_template")
    if chat:
        w.add_chat_template(chat)
