"""Which layers share KV cache pages, and which block table each layer reads: the cache's layout, pure Python.

A model whose layers all attend the same way (all full, or all with one sliding window) has one group: every
layer's K/V for a block of tokens lives in that block's page of every layer, and one block table per sequence
names them, as in vLLM v0.

A hybrid model (gpt-oss: a 128-token window on every other layer; Gemma 3: five windowed layers to one
global) would hold every windowed layer's keys for the whole context that way, though no query reads past
its window. So its layers are split into groups of equal size `group_size`, each group all full or all of
one window, and each group has its own block table per sequence (after vLLM v1's hybrid allocator):

* the cache tensors hold `group_size` layers, not L: a block id is a page of `group_size` layers, taken from
  the one free pool by whichever group needs it;
* layer i reads and writes slot `slot[i]` of those tensors through the block table of group `group[i]`;
* a windowed group's blocks behind its window are released while the sequence runs (BlockManager), so a
  long sequence holds the full groups' blocks plus a window's worth for each windowed group.

The layout changes where K/V live, never a value or the order anything is summed in: the bits do not change.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import gcd


@dataclass(frozen=True)
class KVLayout:
    windows: tuple[int, ...]  # each group's sliding window in tokens (0: full attention), by group id
    group: tuple[int, ...]  # (L,) the group whose block table layer i reads
    slot: tuple[int, ...]  # (L,) layer i's index in the cache tensors' first dimension
    group_size: int  # layers per group: the cache tensors' first dimension

    @property
    def num_groups(self) -> int:
        return len(self.windows)


def plan_kv_layout(layer_windows: list[int]) -> KVLayout:
    """The layout for layers with these windows (0: full attention).

    One group when every layer has the same window or every layer has one (then a block is dead only behind
    the largest window, and the layers keep sharing pages, as they always have). Otherwise the layers of each
    window form groups of gcd(counts) layers, in layer order, full-attention groups first."""
    n = len(layer_windows)
    if n == 0 or len(set(layer_windows)) == 1 or all(layer_windows):
        w = max(layer_windows, default=0)
        return KVLayout((w,), (0,) * n, tuple(range(n)), n)
    by_window: dict[int, list[int]] = {}
    for i, w in enumerate(layer_windows):
        by_window.setdefault(w, []).append(i)
    size = 0
    for layers in by_window.values():
        size = gcd(size, len(layers))
    windows: list[int] = []
    group, slot = [0] * n, [0] * n
    for w in sorted(by_window):  # 0 (full) first
        layers = by_window[w]
        for start in range(0, len(layers), size):
            for k, i in enumerate(layers[start:start + size]):
                group[i], slot[i] = len(windows), k
            windows.append(w)
    return KVLayout(tuple(windows), tuple(group), tuple(slot), size)
