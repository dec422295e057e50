"""BlockManager: the paged KV-cache allocator, pure Python (no torch)."""

from __future__ import annotations

import random

import pytest

from steadyserve.engine.block_manager import BlockManager
from steadyserve.engine.sequence import Request, SamplingParams, Sequence


def make_seq(i: int, prompt_len: int, max_tokens: int = 4) -> Sequence:
    return Sequence(i, Request(f"r{i}", list(range(prompt_len)), SamplingParams(max_tokens=max_tokens)))


def test_no_blocks_is_refused():
    with pytest.raises(ValueError, match="kv-cache-memory"):
        BlockManager(0, 16)


def test_blocks_for_rounds_up():
    bm = BlockManager(10, 4)
    assert [bm.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_can_ever_fit_is_the_whole_cache():
    bm = BlockManager(3, 4)
    assert bm.can_ever_fit(12)
    assert not bm.can_ever_fit(13)


def test_grow_allocates_only_missing_blocks_and_free_returns_them():
    bm = BlockManager(5, 4)
    s = make_seq(0, 10)
    assert bm.num_missing_blocks(s, 5) == 2
    bm.grow(s, 5)  # tokens 0..4 -> 2 blocks
    assert len(s.block_table) == 2 and bm.num_free_blocks == 3
    s.num_computed_tokens = 5
    assert bm.num_missing_blocks(s, 3) == 0  # 8 tokens still fit in 2 blocks
    bm.grow(s, 3)
    assert len(s.block_table) == 2
    s.num_computed_tokens = 8
    bm.grow(s, 1)  # the 9th token opens a third block
    assert len(s.block_table) == 3 and bm.num_free_blocks == 2
    assert bm.usage == pytest.approx(3 / 5)
    table = list(s.block_table)
    bm.free(s)
    assert s.block_table == [] and bm.num_free_blocks == 5 and bm.usage == 0.0
    assert set(table) <= set(range(5))


def test_grow_past_the_pool_raises_and_changes_nothing():
    bm = BlockManager(2, 4)
    s = make_seq(0, 12)
    assert not bm.can_grow(s, 12)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.grow(s, 12)
    assert s.block_table == [] and bm.num_free_blocks == 2


def test_random_alloc_free_never_shares_or_loses_a_block():
    rng = random.Random(0)
    bm = BlockManager(40, 8)
    live: list[Sequence] = []
    for i in range(2000):
        if live and rng.random() < 0.4:
            s = live.pop(rng.randrange(len(live)))
            bm.free(s)
        else:
            s = live[rng.randrange(len(live))] if live and rng.random() < 0.5 else make_seq(i, 200)
            n = rng.randrange(1, 30)
            if bm.can_grow(s, n):
                bm.grow(s, n)
                s.num_computed_tokens += n
                if s not in live:
                    live.append(s)
                assert len(s.block_table) == bm.blocks_for(s.num_computed_tokens)
            else:
                assert bm.num_missing_blocks(s, n) > bm.num_free_blocks
        owned = [b for s in live for b in s.block_table]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert len(owned) + bm.num_free_blocks == bm.num_blocks, "a block leaked"
