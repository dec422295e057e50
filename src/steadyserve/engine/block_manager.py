"""Paged KV-cache block allocator with automatic prefix caching, pure Python.

The cache is a fixed pool of `num_blocks` blocks of `block_size` token slots,
allocated once at start. A sequence owns a list of block ids (its block table);
slot i of the sequence lives in block_table[i // block_size] at offset
i % block_size.

Prefix caching (after vLLM v1's KV cache manager). A block whose slots are all
computed is content-addressed by a hash chain over the tokens up to its end,
rooted in the model's fingerprint: block i's hash covers tokens
[0, (i + 1) * block_size), so equal hashes mean equal prefixes at equal
positions, and therefore (batch-invariant numerics) bitwise-equal K/V. A
request whose prompt starts with cached blocks takes them instead of computing
them. Every block is in exactly one state:

  * owned:  ref_count > 0, one reference per sequence whose block table holds it;
  * cached: ref_count == 0, still holds a hashed prefix, reclaimable;
  * free:   ref_count == 0, no hash.

Sliding windows. When every layer of the model has one (Mistral v0.1, Phi-3-mini), a
block all of whose slots lie before the lowest key any later query can attend to
(position - window + 1, for the largest window) is released at once, as a
finished sequence's blocks are: it becomes free, or cached if it holds a hashed
prefix, and admission counts it free. Its block-table entry becomes RELEASED;
the model runner reads that as block 0, which the attention kernels never touch
for it (the native one starts at the window; the Python one masks it). With a
global layer anywhere (Gemma 2 and 3), nothing is ever out of every window.

Cached and free blocks are both in the free queue, which is in eviction order:
free blocks first, then cached ones, least recently released first.
Allocation takes the head and forgets its hash, so the cache lives inside the
same budget and the memory bound does not change. A sequence releases its
blocks last-first, so a prefix's tail is evicted before its head.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from .sequence import Sequence


RELEASED = -1  # a block-table entry whose block was released out of the window


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True, root: str = "",
                 window: int = 0) -> None:
        """`window`: the largest sliding window when every layer has one, else 0 (blocks stay held)."""
        if num_blocks < 1:
            raise ValueError("the KV cache has no blocks: raise --kv-cache-memory")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.window = window
        self._root = hashlib.sha256(f"steadyserve-prefix:{root}".encode()).digest()  # the chain's start
        self._ref = [0] * num_blocks  # sequences holding each block
        self._hash: list[bytes | None] = [None] * num_blocks  # prefix hash a block holds, if any
        self._cached: dict[bytes, int] = {}  # prefix hash -> the block holding it
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # eviction order
        self.num_queried_tokens = 0  # prompt tokens looked up at admission (for the hit rate)
        self.num_hit_tokens = 0  # of which found in the cache

    # ---- accounting ------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones and cached ones no sequence holds."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a hashed prefix, owned or reclaimable."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences, 0..1 (reclaimable cached blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> bytes | None:
        return self._hash[block_id]

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    # ---- prefix lookup ---------------------------------------------------
    def _prefix_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The hash chain of seq's first `num_blocks` full blocks (extends seq.block_hashes as needed)."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else self._root
            hashes.append(hashlib.sha256(parent + array("q", seq.token_ids[i * bs:(i + 1) * bs]).tobytes()).digest())
        return hashes[:num_blocks]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest prefix of a waiting sequence's tokens.

        At least the last token is left to compute (its step produces the next
        token's distribution), and a sequence that still needs prompt logprobs
        gets no hits: those come from hidden states a cache does not keep.
        """
        if not self.prefix_caching or seq.num_computed_tokens or not seq.prompt_logprobs_done \
                or seq.needs_prompt_rows:  # a mean-pooled embedding: the same, for its hidden rows
            return []
        hits: list[int] = []
        for h in self._prefix_hashes(seq, (seq.num_tokens - 1) // self.block_size):
            block_id = self._cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    # ---- allocation ------------------------------------------------------
    def num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` still needs to hold its computed tokens plus `num_new_tokens`."""
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_missing_blocks(seq, num_new_tokens) <= len(self._free)

    def can_admit(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> bool:
        """Whether `admit(seq, hits, num_new_tokens)` finds the blocks: a reclaimable hit is taken out of
        the free queue, so it cannot also serve as a new block."""
        need = self.blocks_for(len(hits) * self.block_size + num_new_tokens) - len(hits)
        return need <= len(self._free) - sum(1 for b in hits if b in self._free)

    def admit(self, seq: Sequence, hits: list[int], num_new_tokens: int) -> None:
        """Give a waiting sequence its cached prefix blocks, then blocks for `num_new_tokens` more."""
        assert not seq.block_table and not seq.num_computed_tokens, seq
        for block_id in hits:
            self._take(block_id)
        seq.block_table = list(hits)
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits) * self.block_size
        self.num_queried_tokens += seq.num_prompt_tokens
        self.num_hit_tokens += min(seq.num_cached_tokens, seq.num_prompt_tokens)
        self.grow(seq, num_new_tokens)

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        missing = self.num_missing_blocks(seq, num_new_tokens)
        if missing > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {missing}, have {len(self._free)}")
        seq.block_table.extend(self._allocate() for _ in range(missing))

    def cache_full_blocks(self, seq: Sequence, num_new_tokens: int) -> None:
        """Publish the blocks that seq's last `num_new_tokens` computed tokens filled. A prefix someone
        else already published keeps its block; this copy stays private and is freed plainly."""
        first = (seq.num_computed_tokens - num_new_tokens) // self.block_size
        full = seq.num_computed_tokens // self.block_size
        if not self.prefix_caching or first == full:  # most decode steps fill no block
            return
        hashes = self._prefix_hashes(seq, full)
        for i in range(first, full):
            h, block_id = hashes[i], seq.block_table[i]
            if self._hash[block_id] is None and h not in self._cached:
                self._hash[block_id] = h
                self._cached[h] = block_id

    def truncate(self, seq: Sequence) -> int:
        """Release the blocks past what seq's tokens need: after a speculative verification, those hold
        only rejected draft tokens' K/V. They were never full of computed tokens, so never hashed: they
        become free, and the prefix cache never sees a rejected token. Returns how many were released."""
        keep = self.blocks_for(seq.num_tokens)
        extra = seq.block_table[keep:]
        del seq.block_table[keep:]
        for block_id in reversed(extra):
            assert self._hash[block_id] is None, block_id
            self._release(block_id)
        return len(extra)

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks, last first: unhashed ones become free, hashed ones cached."""
        for block_id in reversed(seq.block_table):
            if block_id != RELEASED:
                self._release(block_id)
        seq.block_table = []

    def release_out_of_window(self, seq: Sequence) -> int:
        """Release the blocks no later query of seq can attend to (see the module docstring); how many."""
        if not self.window:
            return 0
        dead = max(0, seq.num_computed_tokens - self.window + 1) // self.block_size  # blocks [0, dead)
        released = 0
        for i in range(min(dead, len(seq.block_table))):
            if seq.block_table[i] != RELEASED:
                self._release(seq.block_table[i])
                seq.block_table[i] = RELEASED
                released += 1
        return released

    def _release(self, block_id: int) -> None:
        self._ref[block_id] -= 1
        assert self._ref[block_id] >= 0, block_id
        if self._ref[block_id] == 0:
            self._free[block_id] = None
            if self._hash[block_id] is None:
                self._free.move_to_end(block_id, last=False)  # used before any cached block is evicted

    def _take(self, block_id: int) -> None:
        if self._ref[block_id] == 0:
            del self._free[block_id]
        self._ref[block_id] += 1

    def _allocate(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        h = self._hash[block_id]
        if h is not None:  # evict: the prefix it held must be computed again
            del self._cached[h]
            self._hash[block_id] = None
        self._ref[block_id] = 1
        return block_id
