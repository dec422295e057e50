"""Prefix caching in the BlockManager, pure Python (no torch): lookups, eviction order, and a
hypothesis state machine that drives admit / grow / share / finish / abort / preempt / evict and
checks the block accounting after every step, for one group of layers and for a hybrid model's two
(full attention and a sliding window, kv_layout.py), whose windowed blocks leave as the window passes."""

from __future__ import annotations

import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from steadyserve.engine.block_manager import RELEASED, BlockManager
from steadyserve.engine.sequence import Request, SamplingParams, Sequence

BS = 4


def make_seq(i: int, tokens: list[int], prompt_logprobs: int | None = None) -> Sequence:
    return Sequence(i, Request(f"r{i}", list(tokens), SamplingParams(max_tokens=4, prompt_logprobs=prompt_logprobs)))


def run_prompt(bm: BlockManager, seq: Sequence) -> list[int]:
    """Admit seq and compute its whole prompt in one step, as the engine would. Returns the hits."""
    hits = bm.match_prefix(seq)
    n = seq.num_tokens - len(hits[0]) * bm.block_size
    assert bm.can_admit(seq, hits, n)
    bm.admit(seq, hits, n)
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq, n)
    return hits


def test_a_shared_prefix_is_found_and_shared_up_to_its_last_full_block():
    bm = BlockManager(20, BS)
    a = make_seq(0, list(range(10)))  # blocks [0..3] [4..7] full, [8, 9] partial
    assert run_prompt(bm, a) == [[]]
    assert bm.num_cached_blocks == 2
    b = make_seq(1, list(range(9)) + [99])  # same first 8 tokens, then differs mid-block
    hits = run_prompt(bm, b)
    assert hits == [a.block_table[:2]] and b.block_table[:2] == hits[0]
    assert b.num_cached_tokens == 8 and all(bm.ref_count(x) == 2 for x in hits[0])
    assert b.block_table[2] != a.block_table[2]  # the partial block is its own


def test_a_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(20, BS)
    run_prompt(bm, make_seq(0, list(range(8))))
    b = make_seq(1, list(range(8)))
    hits = bm.match_prefix(b)
    assert len(hits[0]) == 1  # block 2 would leave nothing to compute: the next token needs a step
    bm.admit(b, hits, b.num_tokens - 4)
    assert b.num_computed_tokens == 4 and len(b.block_table) == 2


def test_the_position_is_part_of_the_hash():
    bm = BlockManager(20, BS)
    run_prompt(bm, make_seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    # The same four tokens as the cached second block, but at the start: no hit.
    assert bm.match_prefix(make_seq(1, [5, 6, 7, 8, 0])) == [[]]


def test_a_request_needing_prompt_logprobs_computes_every_token():
    bm = BlockManager(20, BS)
    run_prompt(bm, make_seq(0, list(range(10))))
    scorer = make_seq(1, list(range(10)), prompt_logprobs=1)
    assert bm.match_prefix(scorer) == [[]]
    scorer.prompt_logprobs_done = True  # e.g. re-admitted after a preemption, logprobs already taken
    assert len(bm.match_prefix(scorer)[0]) == 2


def test_released_blocks_are_cached_and_evicted_least_recently_used_tail_first():
    bm = BlockManager(3, BS)
    a = make_seq(0, list(range(9)))  # 2 full blocks + 1 partial: the whole pool
    run_prompt(bm, a)
    first, second, partial = a.block_table
    bm.free(a)
    assert bm.num_free_blocks == 3 and bm.usage == 0.0  # cached blocks are reclaimable, so free
    assert bm.num_cached_blocks == 2
    # Allocation takes the never-cached blocks first, then the prefix's tail, then its head.
    b = make_seq(1, [50 + i for i in range(8)])
    bm.admit(b, [[]], 8)
    assert partial in b.block_table and second in b.block_table and first not in b.block_table
    assert bm.num_cached_blocks == 1 and bm.block_hash(first) is not None and bm.block_hash(second) is None


def test_a_reclaimable_hit_cannot_also_be_a_new_block():
    bm = BlockManager(2, BS)
    a = make_seq(0, list(range(5)))
    run_prompt(bm, a)
    bm.free(a)  # block with tokens 0..3 cached, the other free: 2 free blocks
    b = make_seq(1, list(range(12)))  # hits 1 block, needs 2 more: 3 in all
    hits = bm.match_prefix(b)
    assert len(hits[0]) == 1
    assert not bm.can_admit(b, hits, 8)
    assert bm.can_admit(b, hits, 4)


def test_caching_off_shares_nothing():
    bm = BlockManager(20, BS, prefix_caching=False)
    run_prompt(bm, make_seq(0, list(range(10))))
    assert bm.num_cached_blocks == 0
    assert run_prompt(bm, make_seq(1, list(range(10)))) == [[]]


# ---- the state machine -------------------------------------------------------------------------------

# Prompts from a few shared stems, so lookups hit, miss, and hit part-way.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 10]


class BlockAccounting(RuleBasedStateMachine):
    windows: tuple[int, ...] = (0,)  # the BlockManager's groups
    num_blocks = 10

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(self.num_blocks, BS, windows=self.windows, max_step_tokens=16)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        # block -> (the group whose layers wrote it, the token prefix its K/V were computed from)
        self.contents: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.next_id = 0

    # -- what the engine does --
    @rule(stem=st.sampled_from(range(len(STEMS))), cut=st.integers(1, 12), tail=st.lists(st.integers(0, 3), max_size=5),
          wants_prompt_logprobs=st.booleans())
    def add(self, stem: int, cut: int, tail: list[int], wants_prompt_logprobs: bool) -> None:
        tokens = STEMS[stem][:cut] + tail
        self.waiting.append(make_seq(self.next_id, tokens, 1 if wants_prompt_logprobs else None))
        self.next_id += 1

    @precondition(lambda self: self.waiting)
    @rule(budget=st.integers(1, 16))
    def admit(self, budget: int) -> None:
        seq = self.waiting[0]
        hits = self.bm.match_prefix(seq)
        for g, table in enumerate(hits):  # a hit holds exactly the prefix the sequence asks for, in its group
            assert len(table) == len(hits[0])
            for i, b in enumerate(table):
                if b == RELEASED:  # only behind the window of the first token left to compute
                    assert self.windows[g] and (i + 1) * BS <= len(table) * BS - self.windows[g] + 1, (g, i)
                else:
                    assert self.contents[b] == (g, tuple(seq.token_ids[:(i + 1) * BS])), (b, g, i)
        n = min(seq.num_tokens - len(hits[0]) * BS, budget)
        if not self.bm.can_admit(seq, hits, n):
            return
        self.waiting.pop(0)
        self.bm.admit(seq, hits, n)
        self.running.append(seq)
        self._compute(seq, n)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100), budget=st.integers(1, 16))
    def step(self, i: int, budget: int) -> None:
        """Compute more of a running sequence: the rest of its prompt, or one decode token (grow)."""
        seq = self.running[i % len(self.running)]
        if seq.num_uncomputed_tokens == 0:
            seq.token_ids.append(seq.num_tokens % 4)  # sampled
        n = min(seq.num_uncomputed_tokens, budget)
        if self.bm.can_grow(seq, n):
            self.bm.grow(seq, n)
            self._compute(seq, n)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100), how=st.sampled_from(["finish", "abort", "preempt"]))
    def release(self, i: int, how: str) -> None:
        seq = self.running.pop(i % len(self.running))
        self.bm.free(seq)
        if how == "preempt":  # recomputed later from its tokens, prompt and generated alike
            seq.num_computed_tokens = 0
            self.waiting.insert(0, seq)

    def _compute(self, seq: Sequence, n: int) -> None:
        start = seq.num_computed_tokens
        for pos in range(start, start + n):  # K/V written slot by slot, by every group's layers
            for g, table in enumerate(seq.block_tables):
                b = table[pos // BS]
                assert b != RELEASED and self.bm.ref_count(b) == 1, "writing into a block another sequence holds"
                self.contents[b] = (g, tuple(seq.token_ids[:pos + 1]))
        seq.num_computed_tokens += n
        if seq.num_computed_tokens >= seq.num_prompt_tokens:
            seq.prompt_logprobs_done = True
        self.bm.cache_full_blocks(seq, n)  # as Scheduler.update, in its order
        self.bm.release_out_of_window(seq)

    # -- what must hold after every rule --
    @invariant()
    def every_block_is_free_cached_or_owned_and_the_counts_add_up(self) -> None:
        bm = self.bm
        holders: dict[int, int] = {}
        for seq in self.running:
            held = [b for t in seq.block_tables for b in t if b != RELEASED]
            assert len(held) == len(set(held)), "a sequence holds a block twice"
            assert len(seq.block_tables) == len(self.windows)
            assert all(len(t) * BS >= seq.num_computed_tokens for t in seq.block_tables)
            for b in held:
                holders[b] = holders.get(b, 0) + 1
        assert all(not s.block_tables for s in self.waiting), "a waiting sequence holds blocks"
        owned = cached = free = 0
        for b in range(bm.num_blocks):
            assert bm.ref_count(b) == holders.get(b, 0), f"block {b}: ref count {bm.ref_count(b)}, held {holders.get(b, 0)}"
            if bm.ref_count(b):
                owned += 1
                assert not bm.is_free(b)
            elif bm.block_hash(b) is not None:
                cached += 1
                assert bm.is_free(b)
            else:
                free += 1
                assert bm.is_free(b)
        assert owned + cached + free == bm.num_blocks
        assert bm.num_free_blocks == cached + free
        hashed = [b for b in range(bm.num_blocks) if bm.block_hash(b) is not None]
        assert len(hashed) == bm.num_cached_blocks, "the hash index and the blocks disagree"

    @invariant()
    def a_hashed_block_holds_a_full_computed_prefix(self) -> None:
        for b in range(self.bm.num_blocks):
            if self.bm.block_hash(b) is not None:
                prefix = self.contents[b][1]
                assert len(prefix) % BS == 0 and prefix, (b, self.contents.get(b))

    @invariant()
    def every_key_a_later_query_reads_is_held_and_is_this_sequences(self) -> None:
        """The attention of each group's next query reads keys from its window's start (0: full attention) to
        the last computed token: each of those blocks is held and holds this sequence's own prefix."""
        for seq in self.running:
            done = seq.num_computed_tokens
            for g, table in enumerate(seq.block_tables):
                w = self.windows[g]
                lo = max(0, done - w + 1) if w else 0  # the lowest key position a later query reads
                for i in range(lo // BS, -(-done // BS)):
                    b = table[i]
                    assert b != RELEASED, f"group {g} released block {i} at {done} computed tokens"
                    assert self.contents[b] == (g, tuple(seq.token_ids[:min((i + 1) * BS, done)])), (g, i, b)
                if w:  # and no more than its window and a step's tokens need (max_step_tokens: 16, as the rules)
                    assert sum(b != RELEASED for b in table) <= self.bm.blocks_for(w + 16) + 1


TestBlockAccounting = BlockAccounting.TestCase
TestBlockAccounting.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


class HybridBlockAccounting(BlockAccounting):
    """gpt-oss's and Gemma 3's kind of model: a full-attention group and a windowed one (6 keys: a block and a
    half), from the one pool."""

    windows = (0, 6)
    num_blocks = 16


TestHybridBlockAccounting = HybridBlockAccounting.TestCase
TestHybridBlockAccounting.settings = settings(max_examples=100, stateful_step_count=60, deadline=None)


def test_the_state_machine_sees_a_hash_without_the_position(monkeypatch):
    """Teeth: a hash of the block's own tokens, without the prefix before it, lets a block computed at
    one position serve another, and the machine's content check catches it."""
    def block_only(self, seq, num_blocks):
        return [bytes(repr(seq.token_ids[i * BS:(i + 1) * BS]), "ascii") for i in range(num_blocks)]

    m = BlockAccounting()
    m.add(stem=0, cut=12, tail=[0], wants_prompt_logprobs=False)  # blocks 1..4, 5..8, 9..12
    m.admit(budget=16)
    m.waiting.append(make_seq(99, [5, 6, 7, 8, 0]))
    m.admit(budget=16)  # the real hash: no hit, no complaint
    monkeypatch.setattr(BlockManager, "_prefix_hashes", block_only)
    m.bm = BlockManager(10, BS)
    m.running, m.contents = [], {}
    m.add(stem=0, cut=12, tail=[0], wants_prompt_logprobs=False)
    m.admit(budget=16)
    m.waiting.append(make_seq(100, [5, 6, 7, 8, 0]))
    with pytest.raises(AssertionError):
        m.admit(budget=16)


# Teeth for the hybrid machine: each fault below breaks one rule of windowed groups, and the machine finds it.
TEETH = settings(max_examples=300, stateful_step_count=60, deadline=None, phases=[Phase.generate], database=None)


def _release_one_block_too_early(self, seq):  # TEST-ONLY fault: a block still inside the window
    for g, table in enumerate(seq.block_tables):
        if self.windows[g]:
            dead = max(0, seq.num_computed_tokens - self.windows[g] + 1) // self.block_size + 1
            for i in range(min(dead, len(table))):
                if table[i] != RELEASED:
                    self._release(table[i])
                    table[i] = RELEASED
    return 0


_first_needed = BlockManager._first_needed


def _hit_one_block_short(self, g, num_blocks):  # TEST-ONLY fault: a hit that leaves out a block the window reads
    first = _first_needed(self, g, num_blocks)
    return first + 1 if self.windows[g] and first < num_blocks else first


_match_prefix = BlockManager.match_prefix


def _hits_from_the_wrong_group(self, seq):  # TEST-ONLY fault: the full group's blocks offered to the windowed one
    hits = _match_prefix(self, seq)
    return [hits[0], list(hits[0])] if hits[0] else hits


@pytest.mark.parametrize("name, fault", [("release_out_of_window", _release_one_block_too_early),
                                         ("_first_needed", _hit_one_block_short),
                                         ("match_prefix", _hits_from_the_wrong_group)])
def test_the_hybrid_machine_catches_a_broken_window_rule(monkeypatch, name, fault):
    monkeypatch.setattr(BlockManager, name, fault)
    with pytest.raises(AssertionError):
        run_state_machine_as_test(HybridBlockAccounting, settings=TEETH)


def test_a_windowed_group_takes_only_the_blocks_its_window_reads():
    """A hybrid prefix hit: the full group takes every block, the windowed group (6 keys) the ones from the next
    token's window on; what it left behind counts as free for admission."""
    bm = BlockManager(20, BS, windows=(0, 6), max_step_tokens=16)
    a = make_seq(0, list(range(13)))
    run_prompt(bm, a)
    full, windowed = [list(t) for t in a.block_tables]
    bm.release_out_of_window(a)  # 13 computed: keys from 8 on, blocks 0 and 1 of the windowed group go
    assert a.block_tables[1][:2] == [RELEASED, RELEASED] and a.block_tables[0] == full
    bm.free(a)
    b = make_seq(1, list(range(13)) + [99])
    hits = bm.match_prefix(b)  # 3 full blocks; the 13th token's window reads keys 7..12: blocks 1 and 2
    assert [len(h) for h in hits] == [3, 3] and hits[1][0] == RELEASED and RELEASED not in hits[1][1:]
    assert hits[0] == full[:3] and hits[1][1:] == windowed[1:3]  # released, then found in the cache
    run_prompt(bm, b)
    assert b.num_cached_tokens == 12
