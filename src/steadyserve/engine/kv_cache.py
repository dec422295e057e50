"""The paged KV cache tensors, sized once from a byte budget, in the storage format of --kv-cache-dtype.

Formats (kernels/csrc/kv_format.h defines the rounding and the q8_0 layout):

* fp32: float32, as computed.
* f16 / bf16: each value rounded to nearest even; 2 bytes.
* q8_0: llama.cpp's q8_0 per 32 values of one token's head, 34 bytes per 32 values. The tensors are int8:
  K (L, NB, Hkv, D + D/16, Bs), the last D/16 rows holding each key's f16 scales; V (L, NB, Hkv, Bs, D + D/16),
  each token's row ending in its scales. Only the native kernels read and write it.

The tensor's dtype is the format (float32, float16, bfloat16, int8), so the native kernels need no other
argument; `KVCache.fmt` names it for the fingerprint, the prefix cache's hashes and the logs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ConfigError
from ..models.args import ModelArgs
from .kv_layout import KVLayout, plan_kv_layout

# --kv-cache-dtype (other than auto) -> the cache tensors' dtype
STORAGE: dict[str, torch.dtype] = {"fp32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
                                   "q8_0": torch.int8}
_OF_ACTIVATIONS = {torch.float32: "fp32", torch.float16: "f16", torch.bfloat16: "bf16"}
Q8_BLOCK = 32  # q8_0 values per scale


@dataclass
class KVCache:
    # Lg: layout.group_size, the layers one block holds (L for a model with one group of layers)
    k: torch.Tensor  # (Lg, NB, Hkv, D, Bs): keys stored transposed, a block is a GEMM operand as is (q8_0: D + D/16)
    v: torch.Tensor  # (Lg, NB, Hkv, Bs, D) (q8_0: D + D/16)
    block_size: int
    fmt: str  # the storage format: fp32 | f16 | bf16 | q8_0
    layout: KVLayout  # which slot of k and v, and which of a sequence's block tables, each layer uses

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


def resolve_kv_dtype(setting: str, activations: torch.dtype, numerics: str = "") -> str:
    """The storage format of --kv-cache-dtype `setting` on numerics path `numerics` (numerics.py's mode).

    auto is f16 on the int8 path: decode attention is bound by the bytes of the cache it reads, f16 halves them,
    and the path's error against float32 stays at most llama.cpp's (whose default cache is f16 too; measured in
    benchmarks/RESULTS.md). Elsewhere auto is the activations' dtype (float32 on the CPU): the portable path's
    exact-parity scoring keeps its float32 cache."""
    if setting != "auto":
        return setting
    return "f16" if numerics == "int8" else _OF_ACTIVATIONS[activations]


def activations_kv_dtype(activations: torch.dtype) -> str:
    """The format that stores the activations' own values: the fingerprint names every other (kv_format_id)."""
    return _OF_ACTIVATIONS[activations]


def check_kv_dtype(fmt: str, args: ModelArgs, native_attention: bool) -> None:
    """Refuse, naming the flag, a format this model or attention path cannot store."""
    if fmt == "q8_0" and not native_attention:
        raise ConfigError("--kv-cache-dtype q8_0 needs the native attention kernel (the Python attention path "
                          "reads fp32, f16 and bf16 caches only); use f16 or bf16, or build the native kernels")
    if fmt == "q8_0" and args.head_dim % Q8_BLOCK:
        raise ConfigError(f"--kv-cache-dtype q8_0 quantizes blocks of {Q8_BLOCK} values of a head: head dim "
                          f"{args.head_dim} is not a multiple of {Q8_BLOCK}; use f16 or bf16")


def _stored_dim(args: ModelArgs, fmt: str) -> int:
    """Elements per stored row of one head: D, and for q8_0 the D/32 f16 scales too (2 bytes each)."""
    return args.head_dim + args.head_dim // 16 if fmt == "q8_0" else args.head_dim


def kv_layout(args: ModelArgs) -> KVLayout:
    """The model's KV layout: its layers' windows decide which share a block table (kv_layout.py)."""
    return plan_kv_layout([args.window(i) for i in range(args.num_layers)])


def bytes_per_block(args: ModelArgs, block_size: int, fmt: str) -> int:
    """Bytes of one block of `block_size` tokens, K and V of every layer of a group (kv_layout.py; every layer
    for a model with one group), in storage format `fmt`."""
    elem = torch.empty((), dtype=STORAGE[fmt]).element_size()
    return 2 * kv_layout(args).group_size * args.num_kv_heads * _stored_dim(args, fmt) * block_size * elem


def allocate_kv_cache(args: ModelArgs, budget_bytes: int, block_size: int, fmt: str,
                      device: torch.device) -> KVCache:
    """Allocate (and touch) the whole cache now, so memory use cannot grow later."""
    per_block = bytes_per_block(args, block_size, fmt)
    num_blocks = budget_bytes // per_block
    if num_blocks < 1:
        raise ValueError(f"--kv-cache-memory {budget_bytes} B holds no block of {block_size} tokens "
                         f"({per_block} B each in {fmt})")
    layout = kv_layout(args)
    shape = (layout.group_size, num_blocks, args.num_kv_heads)
    dim, dtype = _stored_dim(args, fmt), STORAGE[fmt]
    # zeros, not empty: a masked-out padding read must see finite numbers (0 * NaN is NaN); a zero q8_0 scale
    # is a finite zero too.
    k = torch.zeros(*shape, dim, block_size, dtype=dtype, device=device)
    v = torch.zeros(*shape, block_size, dim, dtype=dtype, device=device)
    return KVCache(k=k, v=v, block_size=block_size, fmt=fmt, layout=layout)
