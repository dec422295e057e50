"""A GGUF file's tensors as they are stored: the portable path's weights, with no float32 copy.

gguf_file.read_gguf memory-maps the file (gguf-py's layout, without its per-value parse of the
vocabulary); every 2-D tensor becomes a `QWeight` over that mapping
(its rows of blocks, no conversion), 1-D tensors (norms, biases) become float32 tensors. Names
are translated to the Hugging Face names the model builder uses. llama.cpp's converter permutes
the rows of Llama's q and k projections for its RoPE layout; they are permuted back here as
whole rows, which moves bytes and changes no value (transformers' GGUF loader does the same on
the dequantized values). The config and tokenizer come from the file's metadata through
transformers, or gguf_config.py where transformers has no map (loader.convert_gguf). The host
path's float32 weights come from here too (read_float32), for the files transformers cannot read.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..kernels.quant import FORMATS, QWeight, UnsupportedFormat
from .args import ModelArgs
from .gguf_config import GGUF_ARCHITECTURES
from .gguf_file import GgufFile, GgufTensor, read_gguf

# A 3-D tensor of stacked experts (ggml ne = {K, N, E}) gets this HF name prefix; _split_experts turns it into the
# per-expert names a checkpoint saves ("mlp.experts.{e}.gate_proj.weight"), each a view of its N rows.
_STACKED = "mlp.experts."
_STACKED_NAME = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate_proj|up_proj|down_proj)\.(weight|bias)")
# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_QK_NORM_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Per GGUF architecture, where its names differ from or add to Llama's (gguf-py's TensorNameMap;
# tests/test_gemma3_real.py checks these against it). Gemma's ffn_norm is the MLP's input norm, like
# Llama's, but transformers names it pre_feedforward_layernorm, since post_attention_layernorm
# is Gemma's norm on the attention output.
_ARCH_LAYER_NAMES = {
    "qwen3": {**_LAYER_NAMES, **_QK_NORM_NAMES},
    # the router, and the experts stacked along a third dimension (split per expert by _split_experts)
    "qwen3moe": {**_LAYER_NAMES, **_QK_NORM_NAMES, "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": _STACKED + "gate_proj",
                 "ffn_up_exps": _STACKED + "up_proj", "ffn_down_exps": _STACKED + "down_proj"},
    "phi3": {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},  # fused
    "gemma2": {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    "gemma3": {**_LAYER_NAMES, **_QK_NORM_NAMES, "post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    # OLMo 2 has no norm before attention or the MLP, only after each (and its q/k norms span all heads)
    "olmo2": {**{k: v for k, v in _LAYER_NAMES.items() if k not in ("attn_norm", "ffn_norm")}, **_QK_NORM_NAMES,
              "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"},
    # gpt-oss: its MLP's input norm is post_attention_norm; the router and the stacked experts carry biases (a
    # stacked bias is (N, E): one row of N per expert); attn_sinks are one logit per query head
    "gpt-oss": {**{k: v for k, v in _LAYER_NAMES.items() if k != "ffn_norm"},
                "post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks",
                "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": _STACKED + "gate_proj", "ffn_up_exps": _STACKED + "up_proj",
                "ffn_down_exps": _STACKED + "down_proj"},
    "smollm3": _LAYER_NAMES,  # Llama's names (its rope_freqs and attn_rot_embd are not written for it)
    "granite": _LAYER_NAMES,
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# RoPE tables: computed from the config (args.rope_tables); Phi-3's LongRoPE factors are in it too
_SKIPPED = {"rope_freqs", "rope_factors_long", "rope_factors_short"}
# whose converter interleaves q/k rows (llama.cpp's convert_hf_to_gguf: LlamaModel and its subclasses)
_PERMUTED_ARCHS = {arch for arch, entry in GGUF_ARCHITECTURES.items() if entry.permuted}
# llama.cpp's converter stores Gemma's RMSNorm weights as 1 + w (they scale by (1 + w)); transformers'
# GGUF loader subtracts the 1 again (Gemma2TensorProcessor: `weights - 1` on every "norm.weight").
# That float32 round trip is what the reference computes with, so it is done here the same way.
_NORM_SHIFTED_ARCHS = {"gemma2", "gemma3"}


def hf_name(name: str, arch: str = "llama") -> str | None:
    """The Hugging Face name of GGUF tensor `name` in a file of `arch`; None for tensors the model does not use."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m:
        layer, base, kind = m.groups()
        names = _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
        if base not in names:
            raise UnsupportedFormat(f"{name}: tensor {base!r} is not part of a supported architecture")
        if names[base].endswith(".sinks"):  # a parameter of its own in transformers, not a module's weight
            return f"model.layers.{layer}.{names[base]}"
        return f"model.layers.{layer}.{names[base]}.{kind}"
    base, _, kind = name.rpartition(".")
    if base in _SKIPPED:
        return None
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{kind}"
    raise UnsupportedFormat(f"{name}: tensor is not part of a supported architecture")


def _split_experts(name: str, w: QWeight | torch.Tensor, dims: list[int]) -> dict[str, QWeight | torch.Tensor]:
    """`name`: w under its HF name, or, for a stacked expert tensor (dims {K, N, E}), expert e's N rows under
    "...experts.{e}.<proj>.weight": views of the stored rows (QWeight) or of the float32 matrix, no copy."""
    m = _STACKED_NAME.fullmatch(name)
    if m is None:
        return {name: w}
    if m[3] == "bias":  # (N, E) in ggml order: expert e's N values, as float32 (gpt-oss)
        if len(dims) != 2 or (isinstance(w, QWeight) and w.fmt != 0):
            raise UnsupportedFormat(f"{name}: stacked expert biases must be 2-D F32 (N, experts), not {tuple(dims)}")
        flat = (w.data.view(torch.float32) if isinstance(w, QWeight) else w).reshape(dims[1], dims[0])
        return {f"{m[1]}{e}.{m[2]}.bias": flat[e].clone() for e in range(dims[1])}
    if len(dims) != 3:
        raise UnsupportedFormat(f"{name}: stacked experts must be 3-D (K, N, experts), not {tuple(dims)}")
    n = dims[1]
    out: dict[str, QWeight | torch.Tensor] = {}
    for e in range(dims[2]):
        rows = slice(e * n, (e + 1) * n)
        out[f"{m[1]}{e}.{m[2]}.weight"] = QWeight(w.data[rows], w.fmt, w.k, f"{w.name}[{e}]") \
            if isinstance(w, QWeight) else w[rows]
    return out


def unpermute_order(n_rows: int, n_head: int) -> torch.Tensor:
    """Row order undoing llama.cpp's q/k permutation: (n_head, dim, 2) rows back to (n_head, 2, dim)."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).view(n_head, dim, 2).transpose(1, 2).reshape(-1)


def stored_tensor(t: GgufTensor) -> QWeight | torch.Tensor:
    """One tensor as the native path holds it: a vector (norm, bias) as a float32 copy, a matrix as a QWeight over
    the mapping (no copy). Raises UnsupportedFormat naming the tensor and type when no kernel reads it."""
    fmt = int(t.tensor_type)
    dims = [int(d) for d in t.shape]  # ggml order: dims[0] is the row length K
    if len(dims) == 1 or (len(dims) == 2 and dims[1] == 1):
        if fmt != 0:
            raise UnsupportedFormat(f"{t.name}: 1-D tensors must be F32, not {t.tensor_type.name}")
        return torch.from_numpy(np.array(t.data, dtype=np.float32).reshape(-1))
    if fmt not in FORMATS:
        raise UnsupportedFormat(f"{t.name}: GGUF type {t.tensor_type.name} has no native kernel "
                                f"(supported: {', '.join(sorted(v[0] for v in FORMATS.values()))}); "
                                "--numerics host dequantizes it to float32 instead")
    k, n = dims[0], int(np.prod(dims[1:]))
    raw = np.asarray(t.data).view(np.uint8).reshape(n, -1)
    with np.errstate(all="ignore"):
        data = torch.from_numpy(raw) if raw.flags.writeable else _readonly_view(raw)
    qw = QWeight(data, fmt, k, t.name)
    qw.check()
    return qw


def read_tensors(reader: GgufFile, args: ModelArgs) -> tuple[dict[str, QWeight | torch.Tensor], Any]:
    """The file's tensors under HF names, and the file's memory mapping (the tensors are views of it), for a file
    whose tensors passed gguf_check.check_tensors against `args` (gguf_check.read_stored reads and checks).

    Only the mapping is kept: the config and tokenizer come from the cached HF directory, so the
    vocabulary in the file's metadata is skipped, not parsed (gguf_file.py).

    Raises UnsupportedFormat naming the tensor and type when a tensor has no kernel."""
    arch = str(reader.metadata["general.architecture"])
    num_heads, num_kv_heads = args.num_heads, args.num_kv_heads
    out: dict[str, QWeight | torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name, arch)
        if name is None:
            continue
        w = stored_tensor(t)
        if isinstance(w, torch.Tensor):
            if arch in _NORM_SHIFTED_ARCHS and t.name.endswith("norm.weight"):
                w = w - 1.0  # float32, as transformers' loader (see _NORM_SHIFTED_ARCHS)
        elif arch in _PERMUTED_ARCHS and t.name.endswith(".weight") and (".attn_q." in t.name or ".attn_k." in t.name):
            w = w.permute_rows(unpermute_order(w.n, num_heads if ".attn_q." in t.name else num_kv_heads))
        out.update(_split_experts(name, w, [int(d) for d in t.shape]))
    for name in list(out):  # q/k biases of permuted architectures move with their rows
        t = out[name]
        if arch in _PERMUTED_ARCHS and isinstance(t, torch.Tensor) and re.search(r"\.(q|k)_proj\.bias$", name):
            heads = num_heads if ".q_proj." in name else num_kv_heads
            out[name] = t[unpermute_order(t.numel(), heads)].contiguous()
    mapping = reader.data
    del reader
    return out, mapping


def read_float32(path: Path, num_heads: int, num_kv_heads: int) -> dict[str, torch.Tensor]:
    """The host path's weights for a file transformers cannot read: every tensor as float32 under its HF
    name, dequantized by gguf-py (numpy: no native kernel needed, as the host path must not), with the
    same name map, q/k row order and norm shift as read_tensors. transformers' loader dequantizes with
    the same gguf-py function, so these are the values it would compute with."""
    from gguf import dequantize

    reader = read_gguf(path)
    arch = str(reader.metadata["general.architecture"])
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name, arch)
        if name is None:
            continue
        dims = [int(d) for d in t.shape]  # ggml order: dims[0] is the row length K
        values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        shape = (-1,) if len(dims) == 1 or (len(dims) == 2 and dims[1] == 1) else (int(np.prod(dims[1:])), dims[0])
        w = torch.from_numpy(values.reshape(shape).copy())
        if arch in _NORM_SHIFTED_ARCHS and t.name.endswith("norm.weight"):
            w = w - 1.0
        if arch in _PERMUTED_ARCHS and (".attn_q." in t.name or ".attn_k." in t.name):
            w = w[unpermute_order(w.shape[0], num_heads if ".attn_q." in t.name else num_kv_heads)].contiguous()
        out.update(_split_experts(name, w, dims))
    del reader
    return out


def _readonly_view(raw: np.ndarray) -> torch.Tensor:
    """A tensor over a read-only mapping: torch warns that writes would be undefined; nothing writes."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(raw)
