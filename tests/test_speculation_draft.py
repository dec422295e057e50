"""Speculative drafting without a model: the n-gram lookup, the acceptance record, which sequences draft,
how the scheduler fits a draft, and the block manager's rollback. Pure Python (no torch)."""

from __future__ import annotations

import sys

from steadyserve.engine.block_manager import BlockManager
from steadyserve.engine.scheduler import Scheduler
from steadyserve.engine.sequence import Request, SamplingParams, Sequence, SequenceStatus
from steadyserve.engine.speculation import (FIRST_ACCEPTANCE, MIN_ACCEPTANCE, MIN_PAUSE, Acceptance, NgramIndex,
                                            Speculator)


def test_the_pure_parts_import_no_torch():
    import subprocess

    code = ("import sys; import steadyserve.engine.speculation, steadyserve.engine.scheduler; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- the n-gram index --------------------------------------------------------------------------

def test_lookup_copies_what_followed_the_latest_longest_match():
    idx = NgramIndex(2, 4)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 1, 2, 3]
    # Suffix (1, 2, 3) occurred at 0..2, followed by 4 9 2; (2, 3) also at 5..6, but the longer match wins.
    assert idx.propose(tokens, 3) == [4, 9, 2]
    assert idx.propose(tokens, 1) == [4]
    # Without the longer context only the 2-gram matches: its latest occurrence, followed by 5 1 2.
    assert NgramIndex(2, 2).propose(tokens, 3) == [5, 1, 2]


def test_no_match_no_draft_and_the_suffix_never_matches_itself():
    idx = NgramIndex(2, 4)
    assert idx.propose([1, 2, 3, 4], 4) == []
    assert idx.propose([1, 2], 4) == []
    assert idx.propose([5], 4) == []
    assert idx.propose([1, 2, 1, 2], 0) == []


def test_a_repeating_pattern_drafts_k_tokens_through_its_own_draft():
    # (7, 7) last occurred ending at position 3: the continuation starts at the last token and runs on
    # into the draft itself, so a period-1 loop drafts k tokens, not 1.
    assert NgramIndex(2, 4).propose([7, 7, 7, 7], 5) == [7, 7, 7, 7, 7]
    assert NgramIndex(2, 2).propose([1, 2, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]


def test_the_index_grows_incrementally_and_agrees_with_a_fresh_one():
    import random

    rng = random.Random(3)
    tokens: list[int] = [rng.randrange(6) for _ in range(5)]
    grown = NgramIndex()
    for _ in range(200):
        tokens.extend(rng.randrange(6) for _ in range(rng.randrange(1, 4)))
        assert grown.propose(tokens, 4) == NgramIndex().propose(list(tokens), 4)


def test_lookup_matches_a_brute_force_search():
    import random

    def brute(tokens: list[int], k: int) -> list[int]:
        for n in range(4, 1, -1):
            if len(tokens) <= n:
                continue
            suffix = tokens[-n:]
            for start in range(len(tokens) - 1, n - 1, -1):  # latest first, never the suffix itself
                if tokens[start - n:start] == suffix:
                    full = list(tokens)
                    for j in range(k):
                        full.append(full[start + j])
                    return full[len(tokens):]
        return []

    rng = random.Random(5)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        assert NgramIndex().propose(tokens, 3) == brute(tokens, 3), tokens


# ---- acceptance ---------------------------------------------------------------------------------

def test_low_acceptance_pauses_drafting_with_growing_pauses():
    a = Acceptance()
    assert a.rate == FIRST_ACCEPTANCE and a.allows()
    a.record(3, 0)
    assert a.allows()  # one miss is a divergence point, not a trend
    a.record(3, 0)  # nothing accepted twice: paused
    assert a.rate < MIN_ACCEPTANCE
    assert [a.allows() for _ in range(MIN_PAUSE)] == [False] * MIN_PAUSE
    assert a.allows()
    a.record(3, 0)  # low again: twice the pause
    assert sum(not a.allows() for _ in range(4 * MIN_PAUSE)) == 2 * MIN_PAUSE
    a.record(3, 3)
    a.record(3, 3)
    assert a.allows() and a.rate > MIN_ACCEPTANCE
    assert (a.drafted, a.accepted) == (15, 6)


def test_good_acceptance_keeps_drafting():
    a = Acceptance()
    for _ in range(50):
        assert a.allows()
        a.record(3, 2)


# ---- which sequences draft ----------------------------------------------------------------------

def decoding(seq_id: int, prompt: list[int], generated: list[int], max_tokens: int = 32, **kw) -> Sequence:
    seq = Sequence(seq_id, Request(f"r{seq_id}", prompt, SamplingParams(max_tokens=max_tokens, **kw)))
    seq.token_ids += generated
    seq.num_computed_tokens = seq.num_tokens - 1
    seq.status = SequenceStatus.RUNNING
    return seq


LOOP = [1, 2, 3, 1, 2, 3, 1, 2]


def test_drafts_fill_only_the_spare_cheap_rows_oldest_first():
    spec = Speculator("ngram", cheap_rows=4)
    seqs = [decoding(i, LOOP, []) for i in range(3)]
    spec.draft([(s, spec.new_drafter()) for s in seqs])
    # 3 rows taken by the 3 last tokens: 1 spare, for the oldest sequence.
    assert [s.draft_token_ids for s in seqs] == [[3], [], []]
    one = [decoding(9, LOOP, [])]
    spec.draft([(s, spec.new_drafter()) for s in one])
    assert one[0].draft_token_ids == [3, 1, 2]  # cheap_rows - 1
    busy = [decoding(i, LOOP, []) for i in range(4)]
    spec.draft([(s, spec.new_drafter()) for s in busy])
    assert all(s.draft_token_ids == [] for s in busy)  # a batch of 4 runs exactly as without speculation


def test_no_draft_while_prefilling_with_prompt_logprobs_or_past_max_tokens():
    spec = Speculator("ngram", cheap_rows=16)
    prefilling = decoding(0, LOOP, [])
    prefilling.num_computed_tokens = 2
    scoring = decoding(1, LOOP, [], prompt_logprobs=0)
    last = decoding(2, LOOP, [3], max_tokens=2)  # one token left: nothing to draft before it
    two_left = decoding(3, LOOP, [3], max_tokens=3)  # two left: one draft token, then the sampled one
    spec.draft([(s, spec.new_drafter()) for s in (prefilling, scoring, last, two_left)])
    assert [s.draft_token_ids for s in (prefilling, scoring, last, two_left)] == [[], [], [], [1]]


def test_off_never_drafts_and_records_nothing():
    spec = Speculator("off")
    assert not spec.enabled and spec.new_drafter() is None
    spec.record(None, 3, 3)
    assert spec.take_counts().drafted == 0


def test_record_counts_per_step_and_in_total():
    spec = Speculator("ngram")
    d = spec.new_drafter()
    spec.record(d, 3, 2)
    spec.record(d, 2, 0)
    counts = spec.take_counts()
    assert (counts.drafted, counts.accepted, counts.ratios) == (5, 2, [2 / 3, 0.0])
    assert spec.take_counts().drafted == 0 and (spec.total_drafted, spec.total_accepted) == (5, 2)


# ---- the scheduler and the block manager --------------------------------------------------------

def running(sched: Scheduler, seq: Sequence) -> Sequence:
    sched.block_manager.grow(seq, 1)  # blocks for its computed tokens and the last one
    sched.running.append(seq)
    return seq


def test_a_draft_takes_spare_budget_only_and_never_preempts():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=6)
    a = running(sched, decoding(0, [1, 2, 3], []))  # 3 tokens, computed 2: block 0
    b = running(sched, decoding(1, [4, 5, 6], []))
    a.draft_token_ids = [7, 8, 9, 10, 11, 12]
    out = sched.schedule()
    # Budget 6: b's one token is reserved, so a computes 1 + 4 drafts; a needs a second block for them.
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [(0, 5), (1, 1)]
    assert a.draft_token_ids == [7, 8, 9, 10] and not out.preempted
    # No free block may go to a draft while later sequences could need one.
    bm2 = BlockManager(num_blocks=2, block_size=4)
    sched2 = Scheduler(bm2, max_num_seqs=8, max_num_batched_tokens=64)
    c = running(sched2, decoding(0, [1, 2, 3], []))
    running(sched2, decoding(1, [4, 5, 6], []))
    c.draft_token_ids = [7, 8]
    out2 = sched2.schedule()
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out2.scheduled] == [(0, 1), (1, 1)]
    assert c.draft_token_ids == [] and not out2.preempted


def test_truncate_releases_blocks_past_the_tokens_unhashed():
    bm = BlockManager(num_blocks=6, block_size=4, prefix_caching=True)
    seq = decoding(0, [1, 2, 3, 4, 5, 6], [])  # 6 tokens, 5 computed
    bm.grow(seq, 1)  # 2 blocks
    bm.cache_full_blocks(seq, 5)  # block 0 (tokens 1-4) published
    bm.grow(seq, 6)  # a verification of the last token + 5 drafts: positions 5..10, 3 blocks
    assert len(seq.block_table) == 3
    # Block 1 (positions 4-7) now holds draft K/V in every slot, but only one draft token is accepted:
    # 2 computed (the last token and it), one more sampled, so block 1 is not full of computed tokens.
    seq.token_ids += [7, 8]
    seq.num_computed_tokens += 2
    bm.cache_full_blocks(seq, 2)
    assert bm.truncate(seq) == 1
    assert len(seq.block_table) == bm.blocks_for(seq.num_tokens) == 2
    assert bm.num_cached_blocks == 1  # block 0 only
    assert bm.num_free_blocks == 4


# ---- the flag ------------------------------------------------------------------------------------------

def test_the_flag_maps_onto_its_config_field_and_is_checked():
    import pytest

    from steadyserve.cli import build_parser, config_from_args
    from steadyserve.config import ConfigError, EngineConfig

    parse = build_parser().parse_args
    assert config_from_args(parse(["serve"])).engine.speculation == "off" == EngineConfig().speculation
    assert config_from_args(parse(["serve", "--speculation", "ngram"])).engine.speculation == "ngram"
    with pytest.raises(SystemExit):
        parse(["serve", "--speculation", "eagle"])
    with pytest.raises(ConfigError, match="--speculation ngram needs --batch-invariant"):
        config_from_args(parse(["serve", "--speculation", "ngram", "--no-batch-invariant"]))
    with pytest.raises(ConfigError, match="--speculation must be off or ngram"):
        EngineConfig(speculation="medusa").validate()
