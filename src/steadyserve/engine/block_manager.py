"""Paged KV-cache block allocator, pure Python.

The cache is a fixed pool of `num_blocks` blocks of `block_size` token slots,
allocated once at start. A sequence owns a list of block ids (its block table);
slot i of the sequence lives in block_table[i // block_size] at offset
i % block_size.
"""

from __future__ import annotations

from collections import deque

from .sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache has no blocks: raise --kv-cache-memory")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.num_blocks

    def num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` still needs to hold its computed tokens plus `num_new_tokens`."""
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_missing_blocks(seq, num_new_tokens) <= len(self._free)

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        missing = self.num_missing_blocks(seq, num_new_tokens)
        if missing > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {missing}, have {len(self._free)}")
        seq.block_table.extend(self._free.popleft() for _ in range(missing))

    def free(self, seq: Sequence) -> None:
        self._free.extend(seq.block_table)
        seq.block_table = []
