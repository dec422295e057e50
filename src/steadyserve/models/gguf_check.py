"""What a GGUF file must satisfy before anything is converted, cached or handed to a kernel.

A GGUF file is untrusted input (issue 58). gguf_file.read_gguf refuses a file whose structure is broken (magic,
version, counts, types, offsets, truncation); this module refuses one whose parts disagree, so that a damaged
file ends in one error naming the file's problem, never in a kernel's shape check or a cache entry left behind:

- check_metadata: the values the config is built from, by key, before transformers or gguf_config.py read them:
  integers where counts and widths belong, in range (a damaged block_count must not become a config of 2**32
  layers, nor a context length RoPE tables of 2**31 rows), heads that divide the width.
- check_tensors: every tensor the model reads, against the config the metadata gave (ModelArgs: what the model
  is built with), naming the tensor, its shape, the expected shape and the key each dimension comes from; the
  data layout (gguf_file.check_layout); and, on the native path, the types its kernels read.

Both raise GgufConfigError (UnsupportedFormat for a tensor the architecture or the kernels do not know).
gguf_convert.convert runs both before loader.convert_gguf writes to the conversion cache; read_stored runs
check_tensors at every start of the native path too, since a cache entry may predate these checks. Shapes
are in ggml order, as the file stores them.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType

from ..kernels.quant import QWeight
from .args import ModelArgs
from .gguf import hf_name, read_tensors, stored_tensor
from .gguf_config import GgufConfigError
from .gguf_file import GgufFile, check_layout, read_gguf

_MAX_CONTEXT = 1 << 24  # 16M positions: beyond any released model's; a larger value is a damaged field
_MAX_WIDTH = (1 << 31) - 1  # config fields are int32 in transformers and in the kernels
_MAX_EXPERTS = 1 << 16  # llama.cpp's LLAMA_MAX_EXPERTS is 512; a count beyond any model's is a damaged field
# {arch}.<key> -> (required, lowest, highest): the integers the config is built from. The required ones every
# converter writes (TextModel.set_gguf_parameters); block_count's bound is the tensor count (below).
_INTS = {"context_length": (True, 1, _MAX_CONTEXT), "embedding_length": (True, 1, _MAX_WIDTH),
         "block_count": (True, 1, _MAX_WIDTH), "feed_forward_length": (True, 1, _MAX_WIDTH),
         "attention.head_count": (True, 1, _MAX_WIDTH), "attention.head_count_kv": (False, 1, _MAX_WIDTH),
         "attention.key_length": (False, 1, _MAX_WIDTH), "attention.value_length": (False, 1, _MAX_WIDTH),
         "rope.dimension_count": (False, 1, _MAX_WIDTH), "vocab_size": (False, 1, _MAX_WIDTH),
         "rope.scaling.original_context_length": (False, 1, _MAX_CONTEXT),
         "attention.sliding_window": (False, 0, _MAX_CONTEXT), "expert_count": (False, 1, _MAX_EXPERTS),
         "expert_used_count": (False, 1, _MAX_EXPERTS), "expert_feed_forward_length": (False, 1, _MAX_WIDTH)}
# {arch}.<key>: finite numbers above a bound
_FLOATS = {"attention.layer_norm_rms_epsilon": 0.0, "rope.freq_base": 0.0, "rope.scaling.factor": 0.0}
_INTEGER_TYPES = {GGMLQuantizationType.I8, GGMLQuantizationType.I16, GGMLQuantizationType.I32,
                  GGMLQuantizationType.I64}


def check_metadata(md: dict[str, Any], arch: str, n_tensors: int) -> None:
    """The metadata values a config is built from: GgufConfigError naming the key unless each is a number in range."""
    for name, (required, low, high) in _INTS.items():
        key = f"{arch}.{name}"
        value = md.get(key)
        if name == "block_count":
            high = max(n_tensors, 1)  # every layer has tensors: this bounds every loop over the layers
        if value is None and required:
            raise GgufConfigError(f"metadata key {key!r} is missing")
        if value is not None and type(value) is not int:  # bool is an int too, and no count is one
            raise GgufConfigError(f"metadata key {key!r} is {value!r}: expected an integer")
        if value is not None and not low <= value <= high:
            raise GgufConfigError(f"metadata key {key!r} is {value}: expected {low} to {high}")
    for name, low in _FLOATS.items():
        key = f"{arch}.{name}"
        value = md.get(key)
        if value is not None and (type(value) not in (int, float) or not math.isfinite(value) or value <= low):
            raise GgufConfigError(f"metadata key {key!r} is {value!r}: expected a number above {low}")
    if (base := md.get(f"{arch}.rope.freq_base", 1.0)) < 1:  # the RoPE tables' angles grow as base**(-1)
        raise GgufConfigError(f"metadata key '{arch}.rope.freq_base' is {base!r}: a RoPE base below 1 turns "
                              "its frequencies up, not down")
    for name in ("rope.dimension_count", "attention.key_length"):  # transformers' head_dim for some maps
        if (dim := md.get(f"{arch}.{name}")) is not None and dim % 2:
            raise GgufConfigError(f"metadata key '{arch}.{name}' is {dim}: RoPE turns pairs, so it must be even")
    vocab = md.get("tokenizer.ggml.tokens")  # a string array: its length
    for key, value in md.items():  # transformers indexes the vocabulary and sizes the embedding's padding row by them
        if re.fullmatch(r"tokenizer\.ggml\.\w+_token_id", key) and type(vocab) is int and (
                type(value) is not int or not 0 <= value < vocab):
            raise GgufConfigError(f"metadata key {key!r} is {value!r}: not a token of 'tokenizer.ggml.tokens' "
                                  f"(0 to {vocab - 1})")
    experts, used = md.get(f"{arch}.expert_count"), md.get(f"{arch}.expert_used_count")
    if experts is not None and used is not None and used > experts:
        raise GgufConfigError(f"metadata key '{arch}.expert_used_count' is {used}: more than "
                              f"'{arch}.expert_count' {experts}")
    if arch in ("qwen3moe", "gpt-oss"):  # llama.cpp reads all three for every such file; absent, no model is built
        for name in ("expert_count", "expert_used_count", "expert_feed_forward_length"):
            if f"{arch}.{name}" not in md:
                raise GgufConfigError(f"metadata key '{arch}.{name}' is missing: a {arch} file states its experts")
    width, heads = md[f"{arch}.embedding_length"], md[f"{arch}.attention.head_count"]
    kv = md.get(f"{arch}.attention.head_count_kv", heads)
    if heads % kv:
        raise GgufConfigError(f"metadata key '{arch}.attention.head_count' is {heads}: not a multiple of "
                              f"'{arch}.attention.head_count_kv' {kv}")
    if width % heads:  # transformers' Llama and Gemma configs refuse it; no checkpoint of a served family has it
        raise GgufConfigError(f"metadata key '{arch}.attention.head_count' is {heads}: it does not divide "
                              f"'{arch}.embedding_length' {width}")


def _sources(md: dict[str, Any], arch: str, args: ModelArgs) -> dict[str, str]:
    """For each dimension of the config: its value and the metadata key it comes from, as words for a message.
    The config may come from transformers' map, so the key is found by value among the ones that can give it."""
    candidates = {
        "hidden_size": [f"{arch}.embedding_length"], "intermediate_size": [f"{arch}.feed_forward_length"],
        "num_heads": [f"{arch}.attention.head_count"],
        "num_kv_heads": [f"{arch}.attention.head_count_kv", f"{arch}.attention.head_count"],
        "head_dim": [f"{arch}.attention.key_length", f"{arch}.rope.dimension_count"],
        "vocab_size": [f"{arch}.vocab_size", "tokenizer.ggml.tokens"],
        "num_experts": [f"{arch}.expert_count"], "moe_intermediate_size": [f"{arch}.expert_feed_forward_length"],
    }
    out = {}
    for field, keys in candidates.items():
        value = getattr(args, field)
        key = next((k for k in keys if md.get(k) == value), None)
        if key is not None:
            out[field] = f"{field} {value} from {key!r}"
        elif field == "head_dim" and value * args.num_heads == args.hidden_size:
            out[field] = f"head_dim {value} = {arch}.embedding_length / {arch}.attention.head_count"
        else:
            out[field] = f"{field} {value} (the config's: no key in the file gives it)"
    return out


def _expected(args: ModelArgs, arch: str) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """GGUF base name (after "blk.N.", or a global name) -> (shape in ggml order, the config fields it comes from),
    for every weight the model builder reads with this config (the flags are the ones it reads: args.py) from a
    file of `arch`."""
    h, f, d = args.hidden_size, args.intermediate_size, args.head_dim
    q, kv = args.num_heads * d, args.num_kv_heads * d
    hq, hkv = ("hidden_size", "num_heads", "head_dim"), ("hidden_size", "num_kv_heads", "head_dim")
    layer: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {
        "attn_output": ((q, h), hq),
        "ffn_down": ((f, h), ("intermediate_size", "hidden_size")),
    }
    if args.fused_weights:  # Phi-3: q|k|v and gate|up as one matrix each
        layer["attn_qkv"] = ((h, q + 2 * kv), hq + ("num_kv_heads",))
        layer["ffn_up"] = ((h, 2 * f), ("hidden_size", "intermediate_size"))
    else:
        layer.update({"attn_q": ((h, q), hq), "attn_k": ((h, kv), hkv), "attn_v": ((h, kv), hkv),
                      "ffn_gate": ((h, f), ("hidden_size", "intermediate_size")),
                      "ffn_up": ((h, f), ("hidden_size", "intermediate_size"))})
    if any(args.layer_moe):  # llama.cpp's qwen3moe and gpt-oss: every layer sparse (a dense one is refused as unread)
        if not all(args.layer_moe):
            raise GgufConfigError(f"a GGUF model with dense and sparse layers is not supported (llama.cpp's {arch} "
                                  "makes every layer sparse)")
        e, fe = args.num_experts, args.moe_intermediate_size
        ex = ("hidden_size", "moe_intermediate_size", "num_experts")
        for dense in ("ffn_gate", "ffn_up", "ffn_down"):
            layer.pop(dense, None)
        layer.update({"ffn_gate_inp": ((h, e), ("hidden_size", "num_experts")),
                      "ffn_gate_exps": ((h, fe, e), ex), "ffn_up_exps": ((h, fe, e), ex),
                      "ffn_down_exps": ((fe, h, e), ex)})
    if args.pre_norm:  # gpt-oss names its MLP's input norm post_attention_norm
        layer.update({"attn_norm": ((h,), ("hidden_size",)),
                      "post_attention_norm" if arch == "gpt-oss" else "ffn_norm": ((h,), ("hidden_size",))})
    if args.attn_sinks:
        layer["attn_sinks"] = ((args.num_heads,), ("num_heads",))
    if args.sandwich_norm:
        layer.update({"post_attention_norm": ((h,), ("hidden_size",)), "post_ffw_norm": ((h,), ("hidden_size",))})
    if args.qk_norm:
        per_head = args.qk_norm_per_head
        layer["attn_q_norm"] = ((d,), ("head_dim",)) if per_head else ((q,), hq[1:])
        layer["attn_k_norm"] = ((d,), ("head_dim",)) if per_head else ((kv,), hkv[1:])
    biased = [("attn_q", args.qkv_bias), ("attn_k", args.qkv_bias), ("attn_v", args.qkv_bias),
              ("attn_qkv", args.qkv_bias), ("attn_output", args.o_bias), ("ffn_gate", args.mlp_bias),
              ("ffn_up", args.mlp_bias), ("ffn_down", args.mlp_bias)]
    out = {f"{base}.weight": v for base, v in layer.items()}
    out.update({f"{base}.bias": ((out[f"{base}.weight"][0][1],), out[f"{base}.weight"][1])
                for base, on in biased if on and f"{base}.weight" in out})
    if arch == "gpt-oss":  # the router's bias (E,), and each stacked expert matrix's (N, E): one row of N per expert
        out["ffn_gate_inp.bias"] = ((args.num_experts,), ("num_experts",))
        for base in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            (_, n, e), fields = out[f"{base}.weight"]
            out[f"{base}.bias"] = ((n, e), fields)
    return out


def check_tensors(f: GgufFile, args: ModelArgs, native: bool) -> None:
    """Every tensor against the config (names, layers, shapes), then the data layout, then the types: the first
    problem as a GgufConfigError (or UnsupportedFormat) naming the tensor and the key at fault."""
    arch = str(f.metadata["general.architecture"])
    why = _sources(f.metadata, arch, args)
    layer = _expected(args, arch)
    vocab = ("hidden_size", "vocab_size")
    glob = {"token_embd.weight": ((args.hidden_size, args.vocab_size), vocab),
            "output_norm.weight": ((args.hidden_size,), ("hidden_size",)),
            "output.weight": ((args.hidden_size, args.vocab_size), vocab)}
    seen = set()
    for t in f.tensors:
        if hf_name(t.name, arch) is None:  # RoPE factor tables: computed from the config, not read
            continue
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
        if m and int(m[1]) >= args.num_layers:
            raise GgufConfigError(f"tensor {t.name!r} is for layer {m[1]}, but '{arch}.block_count' is "
                                  f"{args.num_layers}")
        shape, fields = layer.get(m[2], ((), ())) if m else glob.get(t.name, ((), ()))
        if not shape:
            raise GgufConfigError(f"tensor {t.name!r} is not read by a {arch} model with this file's metadata")
        if t.shape != shape and t.shape != shape + (1,):  # a vector may be stored as (n, 1)
            raise GgufConfigError(f"tensor {t.name!r} has shape {t.shape}, expected {shape} for "
                                  + ", ".join(why[x] for x in dict.fromkeys(fields)))
        seen.add(t.name)
    wanted = [f"blk.{i}.{base}" for i in range(args.num_layers) for base in layer]
    wanted += ["token_embd.weight", "output_norm.weight"] + ([] if args.tie_word_embeddings else ["output.weight"])
    for name in wanted:
        if name not in seen:
            raise GgufConfigError(f"tensor {name!r} is missing: a {arch} model of {args.num_layers} layers "
                                  f"('{arch}.block_count') with this file's metadata reads it")
    check_layout(f)
    for t in f.tensors:
        if t.tensor_type in _INTEGER_TYPES and t.name in seen:
            raise GgufConfigError(f"tensor {t.name!r} has the integer type {t.tensor_type.name}: a weight is "
                                  "stored as floats or quantized blocks")
        if native and t.name in seen:
            stored_tensor(t)  # UnsupportedFormat for a type the kernels cannot read, as gguf.read_tensors says it


def read_stored(path: Path, args: ModelArgs) -> tuple[dict[str, QWeight | torch.Tensor], Any]:
    """gguf.read_tensors of the file once its tensors have passed check_tensors against `args` (the types are
    refused by read_tensors itself, in the same words)."""
    f = read_gguf(path)
    check_tensors(f, args, native=False)
    return read_tensors(f, args)
