"""The paged KV cache tensors, sized once from a byte budget."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.args import ModelArgs


@dataclass
class KVCache:
    k: torch.Tensor  # (L, NB, Hkv, D, Bs): keys stored transposed, a block is a GEMM operand as is
    v: torch.Tensor  # (L, NB, Hkv, Bs, D)
    block_size: int

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


def bytes_per_block(args: ModelArgs, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * args.num_layers * args.num_kv_heads * args.head_dim * block_size * elem


def allocate_kv_cache(args: ModelArgs, budget_bytes: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> KVCache:
    """Allocate (and touch) the whole cache now, so memory use cannot grow later."""
    num_blocks = budget_bytes // bytes_per_block(args, block_size, dtype)
    if num_blocks < 1:
        raise ValueError(f"--kv-cache-memory {budget_bytes} B holds no block of {block_size} tokens "
                         f"({bytes_per_block(args, block_size, dtype)} B each)")
    shape = (args.num_layers, num_blocks, args.num_kv_heads)
    # zeros, not empty: a masked-out padding read must see finite numbers (0 * NaN is NaN).
    k = torch.zeros(*shape, args.head_dim, block_size, dtype=dtype, device=device)
    v = torch.zeros(*shape, block_size, args.head_dim, dtype=dtype, device=device)
    return KVCache(k=k, v=v, block_size=block_size)
