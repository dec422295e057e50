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

Groups and sliding windows (kv_layout.py). Each group of layers has its own block
table per sequence (`seq.block_tables[g]`); all groups allocate from the one pool, and
a prefix's hash is published per group. A group with a sliding window releases, as a
finished sequence does, each block all of whose slots lie before the lowest key any
later query can attend to (position - window + 1): it becomes free, or cached if it
holds a hashed prefix, and admission counts it free. Its block-table entry becomes
RELEASED; the model runner reads that as block 0, which the attention kernels never
touch for it (the native one starts at the window; the Python one masks it). A
prefix-cache hit of n blocks needs, in each windowed group, only the blocks its next
query's window reaches. A model with one group whose layers all have windows (Mistral
v0.1, Phi-3-mini) releases behind the largest; full attention releases nothing.

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


Hits = list[list[int]]  # a prefix-cache hit: per group, the blocks a sequence takes (RELEASED where not needed)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True, root: str = "",
                 windows: tuple[int, ...] = (0,), max_step_tokens: int = 0) -> None:
        """`windows`: each group's sliding window (0: full attention; KVLayout.windows). `max_step_tokens`: the
        most tokens one step computes for a sequence (the scheduler's budget), which bounds what a windowed
        group holds at once (0: unknown, then it may hold the whole sequence)."""
        if num_blocks < 1:
            raise ValueError("the KV cache has no blocks: raise --kv-cache-memory")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.windows = tuple(windows)
        self.max_step_tokens = max_step_tokens
        self._root = hashlib.sha256(f"steadyserve-prefix:{root}".encode()).digest()  # the chain's start
        self._ref = [0] * num_blocks  # sequences holding each block
        self._hash: list[tuple[int, bytes] | None] = [None] * num_blocks  # (group, prefix hash) a block holds
        self._cached: dict[tuple[int, bytes], int] = {}  # (group, prefix hash) -> the block holding it
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # eviction order
        self.num_queried_tokens = 0  # prompt tokens looked up at admission (for the hit rate)
        self.num_hit_tokens = 0  # of which found in the cache

    # ---- accounting ------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.windows)

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

    def blocks_held_at_most(self, num_tokens: int) -> int:
        """The most blocks one sequence of `num_tokens` tokens holds at once, over its groups: a windowed group
        holds its window, the step's tokens and a block each side of them when the step budget is known."""
        held = 0
        for w in self.windows:
            need = self.blocks_for(num_tokens)
            if w and self.max_step_tokens:
                need = min(need, self.blocks_for(w + self.max_step_tokens) + 1)
            held += need
        return held

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_held_at_most(num_tokens) <= self.num_blocks

    def token_capacity(self, limit: int) -> int:
        """The longest sequence, up to `limit` tokens, that fits the whole cache alone."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.can_ever_fit(mid) else (lo, mid - 1)
        return lo

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def block_hash(self, block_id: int) -> bytes | None:
        key = self._hash[block_id]
        return key[1] if key is not None else None

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

    def _first_needed(self, g: int, num_blocks: int) -> int:
        """The first of a sequence's first `num_blocks` blocks that group g's later queries can read: the next
        token, at position num_blocks * block_size, attends back to its window's start and no further."""
        w = self.windows[g]
        return max(0, num_blocks * self.block_size - w + 1) // self.block_size if w else 0

    def match_prefix(self, seq: Sequence) -> Hits:
        """Cached blocks holding the longest prefix of a waiting sequence's tokens, per group; every group's
        list has the same length n (blocks before a windowed group's window are RELEASED entries).

        At least the last token is left to compute (its step produces the next
        token's distribution), and a sequence that still needs prompt logprobs
        gets no hits: those come from hidden states a cache does not keep.
        """
        if not self.prefix_caching or seq.num_computed_tokens or not seq.prompt_logprobs_done \
                or seq.needs_prompt_rows:  # a mean-pooled embedding: the same, for its hidden rows
            return [[] for _ in self.windows]
        hashes = self._prefix_hashes(seq, (seq.num_tokens - 1) // self.block_size)
        cached = self._cached
        n = len(hashes)
        for g, w in enumerate(self.windows):  # a full group needs every block from the first
            if not w:
                n = next((i for i in range(n) if (g, hashes[i]) not in cached), n)
        while n and not all((g, hashes[i]) in cached for g, w in enumerate(self.windows) if w
                            for i in range(self._first_needed(g, n), n)):
            n -= 1
        hits = []
        for g in range(self.num_groups):
            first = self._first_needed(g, n)
            hits.append([RELEASED] * first + [cached[(g, hashes[i])] for i in range(first, n)])
        return hits

    # ---- allocation ------------------------------------------------------
    def num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` still needs to hold its computed tokens plus `num_new_tokens`."""
        need = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        if not seq.block_tables:
            return need * self.num_groups
        return sum(max(0, need - len(t)) for t in seq.block_tables)

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_missing_blocks(seq, num_new_tokens) <= len(self._free)

    def can_admit(self, seq: Sequence, hits: Hits, num_new_tokens: int) -> bool:
        """Whether `admit(seq, hits, num_new_tokens)` finds the blocks: a reclaimable hit is taken out of
        the free queue, so it cannot also serve as a new block."""
        n = len(hits[0])
        need = (self.blocks_for(n * self.block_size + num_new_tokens) - n) * self.num_groups
        return need <= len(self._free) - sum(1 for h in hits for b in h if b != RELEASED and b in self._free)

    def admit(self, seq: Sequence, hits: Hits, num_new_tokens: int) -> None:
        """Give a waiting sequence its cached prefix blocks, then blocks for `num_new_tokens` more."""
        assert not seq.block_tables and not seq.num_computed_tokens, seq
        for h in hits:
            for block_id in h:
                if block_id != RELEASED:
                    self._take(block_id)
        seq.block_tables = [list(h) for h in hits]
        seq.num_computed_tokens = seq.num_cached_tokens = len(hits[0]) * self.block_size
        self.num_queried_tokens += seq.num_prompt_tokens
        self.num_hit_tokens += min(seq.num_cached_tokens, seq.num_prompt_tokens)
        self.grow(seq, num_new_tokens)

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        missing = self.num_missing_blocks(seq, num_new_tokens)
        if missing > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {missing}, have {len(self._free)}")
        if not seq.block_tables:
            seq.block_tables = [[] for _ in self.windows]
        need = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        for table in seq.block_tables:
            table.extend(self._allocate() for _ in range(need - len(table)))

    def cache_full_blocks(self, seq: Sequence, num_new_tokens: int) -> None:
        """Publish the blocks that seq's last `num_new_tokens` computed tokens filled, in every group. A prefix
        someone else already published keeps its block; this copy stays private and is freed plainly."""
        first = (seq.num_computed_tokens - num_new_tokens) // self.block_size
        full = seq.num_computed_tokens // self.block_size
        if not self.prefix_caching or first == full:  # most decode steps fill no block
            return
        hashes = self._prefix_hashes(seq, full)
        for g, table in enumerate(seq.block_tables):
            for i in range(first, full):
                key, block_id = (g, hashes[i]), table[i]
                if block_id != RELEASED and self._hash[block_id] is None and key not in self._cached:
                    self._hash[block_id] = key
                    self._cached[key] = block_id

    def truncate(self, seq: Sequence) -> int:
        """Release the blocks past what seq's tokens need: after a speculative verification, those hold
        only rejected draft tokens' K/V. They were never full of computed tokens, so never hashed: they
        become free, and the prefix cache never sees a rejected token. Returns how many were released."""
        keep = self.blocks_for(seq.num_tokens)
        released = 0
        for table in seq.block_tables:
            extra = table[keep:]
            del table[keep:]
            for block_id in reversed(extra):
                assert self._hash[block_id] is None, block_id
                self._release(block_id)
            released += len(extra)
        return released

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks, last first: unhashed ones become free, hashed ones cached."""
        for table in reversed(seq.block_tables):
            for block_id in reversed(table):
                if block_id != RELEASED:
                    self._release(block_id)
        seq.block_tables = []

    def release_out_of_window(self, seq: Sequence) -> int:
        """Release the blocks no later query of seq can attend to, in each windowed group (see the module
        docstring); how many."""
        released = 0
        for g, table in enumerate(seq.block_tables):
            if not self.windows[g]:
                continue
            dead = max(0, seq.num_computed_tokens - self.windows[g] + 1) // self.block_size  # blocks [0, dead)
            for i in range(min(dead, len(table))):
                if table[i] != RELEASED:
                    self._release(table[i])
                    table[i] = RELEASED
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
