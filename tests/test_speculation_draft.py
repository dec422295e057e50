"""Speculative drafting without a model: the n-gram lookup, the acceptance record, which sequences draft,
how the scheduler fits a draft, and the block manager's rollback. Pure Python (no torch)."""

from __future__ import annotations

import sys

from steadyserve.engine.block_manager import BlockManager
from steadyserve.engine.scheduler import Scheduler
from steadyserve.engine.sequence import Request, SamplingParams, Sequence, SequenceStatus
from steadyserve.engine.speculation import (EMA_WEIGHT, FIRST_ACCEPTANCE, RESYNC_WINDOW, ROW_COST, Acceptance,
                                           NgramIndex, Speculator, TokenKeys)


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


def brute(tokens: list[int], k: int, cursor: int = -1, keys: list[int] | None = None) -> list[int]:
    """The lookup by exhaustive search: the longest suffix (4 down to 2 tokens, compared by key) that occurred
    before; of its occurrences the first whose continuation starts at or after `cursor`, else the latest.
    Without one, the last token alone, if it occurred with its continuation within RESYNC_WINDOW past the
    cursor."""
    kt = [keys[t] for t in tokens] if keys else list(tokens)
    for n in range(4, 1, -1):
        if len(tokens) <= n:
            continue
        starts = [s for s in range(n, len(tokens)) if kt[s - n:s] == kt[-n:]]  # never the suffix itself
        if not starts:
            continue
        after = [s for s in starts if s >= cursor] if cursor >= 0 else []
        return copy(tokens, after[0] if after else starts[-1], k)
    ahead = [s for s in range(1, len(tokens)) if kt[s - 1] == kt[-1] and s >= cursor >= 0]
    return copy(tokens, ahead[0], k) if ahead and ahead[0] - cursor <= RESYNC_WINDOW else []


def copy(tokens: list[int], start: int, k: int) -> list[int]:
    full = list(tokens)
    for j in range(k):
        full.append(full[start + j])
    return full[len(tokens):]


def test_lookup_matches_a_brute_force_search():
    import random

    rng = random.Random(5)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        assert NgramIndex().propose(tokens, 3) == brute(tokens, 3), tokens


def test_the_index_grows_incrementally_and_agrees_with_the_brute_force_search_at_its_cursor():
    import random

    rng = random.Random(3)
    moved = 0
    for _ in range(20):
        tokens: list[int] = [rng.randrange(6) for _ in range(5)]
        grown = NgramIndex()
        cursors = set()
        for _ in range(60):
            draft = grown.propose(tokens, 4)
            assert draft == brute(tokens, 4, grown.cursor), (tokens, grown.cursor)
            cursors.add(grown.cursor)
            # mostly copy part of the draft, sometimes not: the cursor follows both
            follow = draft[:rng.randrange(1, len(draft) + 1)] if draft and rng.random() < 0.7 else []
            tokens.extend(follow or [rng.randrange(6) for _ in range(rng.randrange(1, 4))])
        moved += len(cursors) > 3
    assert moved >= 15  # the cursor moved, so the test compared more than the latest-occurrence rule


def test_the_cursor_picks_the_occurrence_after_the_last_copy():
    # The source has (3, 4) twice, with different continuations; the output copies the source in order.
    #         0  1  2  3  4  5  6  7  8  9
    source = [1, 3, 4, 5, 6, 2, 3, 4, 7, 8]
    idx = NgramIndex(2, 2)
    tokens = source + [9, 1, 3]
    assert idx.propose(tokens, 2) == [4, 5]  # (1, 3) occurs once: its continuation starts at 2
    tokens += [4, 5, 6, 2]  # the output copied 4, 5, 6, 2: the cursor is past the 2, at 6
    assert idx.propose(tokens, 2) == [3, 4] and idx.cursor == 6  # (6, 2) after the copy
    tokens += [3, 4]
    # (3, 4) occurs at 1..2 and 6..7 of the source, and at 12..13 (the output's first copy, followed by 5, 6):
    # the latest occurrence is the output's; the cursor (8: the output just copied 6..7) takes 6..7's, followed
    # by 7, 8.
    assert idx.propose(tokens, 2) == [7, 8] and idx.cursor == 8
    assert NgramIndex(2, 2).propose(tokens, 2) == [5, 6]  # no cursor: the latest occurrence


def test_after_a_word_of_its_own_the_copy_resumes_just_ahead_of_the_cursor():
    #         0  1  2  3  4  5  6  7  8
    source = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    idx = NgramIndex(2, 4)
    tokens = source + [0, 1, 2]
    assert idx.propose(tokens, 2) == [3, 4]  # (1, 2) at 0..1
    tokens += [3, 99, 5]  # copied 3 (the cursor: 3), then a word of its own, then 5 from the source again
    assert idx.propose(tokens, 3) == [6, 7, 8] and idx.cursor == 3  # (99, 5) never occurred: 5 alone, 2 ahead
    assert NgramIndex(2, 4).propose(tokens, 3) == []  # nothing copied yet, no cursor: no single-token guess
    # The window: source token t at position t - 1, its continuation at t; the cursor at 3 after copying 3.
    for resumed, guess in ((3 + RESYNC_WINDOW, [4 + RESYNC_WINDOW]), (4 + RESYNC_WINDOW, [])):
        far = NgramIndex(2, 4)
        far_tokens = list(range(1, 20)) + [0, 1, 2]
        assert far.propose(far_tokens, 1) == [3]
        far_tokens += [3, 99, resumed]  # continuation RESYNC_WINDOW past the cursor: guessed; one more: not
        assert far.propose(far_tokens, 1) == guess and far.cursor == 3


def test_keys_join_tokens_that_differ_only_in_case_and_surrounding_space():
    texts = ["The", " the", "the", " THE", " ", "  ", "\n", " cat", "cat", "."]
    asked: list[int] = []
    keys = TokenKeys(lambda t: asked.append(t) or texts[t])
    assert keys(0) == keys(1) == keys(2) == keys(3)
    assert len({keys(4), keys(5), keys(6)}) == 3  # whitespace-only tokens keep their own key
    assert keys(7) == keys(8) and len({keys(0), keys(7), keys(9)}) == 3
    assert sorted(asked) == list(range(10))  # each token's text is asked for once, when first looked up
    # " The cat." in the source, "the cat" (say, after a quote) in the output: the copy continues.
    #         0  1  2  3  4
    tokens = [0, 7, 9, 5, 2, 8]
    assert NgramIndex(2, 2, keys=keys).propose(tokens, 1) == [9]
    assert NgramIndex(2, 2).propose(tokens, 1) == []  # by id: no match
    table = [keys(t) for t in range(len(texts))]
    import random

    rng = random.Random(7)
    for _ in range(200):
        tokens = [rng.randrange(len(texts)) for _ in range(rng.randrange(1, 25))]
        assert NgramIndex(keys=keys).propose(tokens, 3) == brute(tokens, 3, keys=table), tokens


# ---- acceptance ---------------------------------------------------------------------------------

def test_p_counts_draft_tokens_up_to_the_first_rejection():
    a = Acceptance()
    assert a.p == FIRST_ACCEPTANCE
    a.record(3, 3)  # 3 trials, 3 hits
    assert a.p == (1 - EMA_WEIGHT) * FIRST_ACCEPTANCE + EMA_WEIGHT
    p = a.p
    a.record(5, 1)  # accepted 1, rejected the 2nd: 2 trials (what followed the rejection tells nothing)
    assert a.p == (1 - EMA_WEIGHT) * p + EMA_WEIGHT * 0.5
    assert (a.drafted, a.accepted) == (8, 4)


def test_a_guess_not_computed_is_scored_when_its_token_arrives():
    a = Acceptance()
    tokens = [1, 2, 3]
    a.guess_next(tokens, 7)
    a.observe(tokens)  # the token is not there yet: nothing to score
    assert a.p == FIRST_ACCEPTANCE and a.guess_pos == 3
    a.observe(tokens + [7])
    assert a.p == (1 - EMA_WEIGHT) * FIRST_ACCEPTANCE + EMA_WEIGHT and a.guess_pos == -1
    a.observe(tokens + [7, 8])  # scored once only
    assert a.p == (1 - EMA_WEIGHT) * FIRST_ACCEPTANCE + EMA_WEIGHT
    a.guess_next(tokens + [7], 5)
    a.observe(tokens + [7, 8])  # a miss
    assert a.p == (1 - EMA_WEIGHT) * ((1 - EMA_WEIGHT) * FIRST_ACCEPTANCE + EMA_WEIGHT)
    assert (a.drafted, a.accepted) == (0, 0)  # guesses are not verifications: no metric counts them


# ---- which sequences draft ----------------------------------------------------------------------

def decoding(seq_id: int, prompt: list[int], generated: list[int], max_tokens: int = 32, **kw) -> Sequence:
    seq = Sequence(seq_id, Request(f"r{seq_id}", prompt, SamplingParams(max_tokens=max_tokens, **kw)))
    seq.token_ids += generated
    seq.num_computed_tokens = seq.num_tokens - 1
    seq.status = SequenceStatus.RUNNING
    return seq


LOOP = [1, 2, 3, 1, 2, 3, 1, 2]


def drafting(spec: Speculator, seqs: list[Sequence]) -> list[Sequence]:
    """`seqs`, each given a fresh drafter (the engine gives one to each generation it admits)."""
    for s in seqs:
        s.drafter = spec.new_drafter()
    return seqs


def test_drafts_fill_only_the_spare_cheap_rows_oldest_first():
    spec = Speculator("ngram", cheap_rows=4, row_cost=0.0)  # every spare row pays
    seqs = [decoding(i, LOOP, []) for i in range(3)]
    spec.draft(drafting(spec, seqs))
    # 3 rows taken by the 3 last tokens: 1 spare, for the oldest sequence.
    assert [s.draft_token_ids for s in seqs] == [[3], [], []]
    one = [decoding(9, LOOP, [])]
    spec.draft(drafting(spec, one))
    assert one[0].draft_token_ids == [3, 1, 2]  # cheap_rows - 1
    busy = [decoding(i, LOOP, []) for i in range(4)]
    spec.draft(drafting(spec, busy))
    assert all(s.draft_token_ids == [] for s in busy)  # a batch of 4 runs exactly as without speculation


def drafts_at(p: float, num_seqs: int = 1, cheap_rows: int = 8, row_cost: float = ROW_COST) -> list[int]:
    """Draft tokens each of num_seqs copying sequences gets when its acceptance estimate is p."""
    spec = Speculator("ngram", cheap_rows=cheap_rows, row_cost=row_cost)
    seqs = [decoding(i, LOOP * 3, []) for i in range(num_seqs)]
    for s in drafting(spec, seqs):
        s.drafter.acceptance.p = p
    spec.draft(seqs)
    return [len(s.draft_token_ids) for s in seqs]


def expected_rate(p: float, k: int, row_cost: float = ROW_COST) -> float:
    """Tokens per one-row step of a lone sequence drafting k tokens at acceptance p."""
    return sum(p ** j for j in range(k + 1)) / (1 + row_cost * k)


def test_a_lone_sequence_drafts_the_number_of_tokens_that_maximises_its_rate():
    for p in (0.0, 0.1, 0.19, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 1.0):
        (k,) = drafts_at(p)
        best = max(range(8), key=lambda j: (round(expected_rate(p, j), 12), -j))
        assert k == best, (p, k, best)
    assert drafts_at(0.1) == [0] and drafts_at(1.0) == [7]  # not copying: nothing; copying: every cheap row


def test_batches_draft_less_and_a_busy_batch_none():
    assert drafts_at(0.8, num_seqs=1) == [4]
    two = drafts_at(0.8, num_seqs=2)
    assert sum(two) < 2 * 4 and two[0] >= two[1]
    assert drafts_at(0.99, num_seqs=8) == [0] * 8  # no spare row
    assert drafts_at(0.5, num_seqs=6) == [0] * 6  # spare rows, but a row costs more than it would add


def test_a_step_that_does_not_draft_keeps_a_guess_that_scores_the_sequence():
    spec = Speculator("ngram", cheap_rows=8)
    seq = decoding(0, LOOP * 3, [])
    drafter = seq.drafter = spec.new_drafter()
    drafter.acceptance.p = 0.05  # not worth a row
    spec.draft([seq])
    assert seq.draft_token_ids == [] and drafter.acceptance.guess_pos == seq.num_tokens
    for _ in range(4):  # the sequence now follows its guesses: p recovers and drafting resumes
        seq.token_ids.append(drafter.acceptance.guess)
        seq.num_computed_tokens = seq.num_tokens - 1
        spec.draft([seq])
        if seq.draft_token_ids:
            break
    assert seq.draft_token_ids, drafter.acceptance.p


def test_no_draft_while_prefilling_with_prompt_logprobs_or_past_max_tokens():
    spec = Speculator("ngram", cheap_rows=16)
    prefilling = decoding(0, LOOP, [])
    prefilling.num_computed_tokens = 2
    scoring = decoding(1, LOOP, [], prompt_logprobs=0)
    last = decoding(2, LOOP, [3], max_tokens=2)  # one token left: nothing to draft before it
    two_left = decoding(3, LOOP, [3], max_tokens=3)  # two left: one draft token, then the sampled one
    spec.draft(drafting(spec, [prefilling, scoring, last, two_left]))
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
    assert config_from_args(parse(["serve"])).engine.speculation == "auto" == EngineConfig().speculation
    assert config_from_args(parse(["serve", "--no-batch-invariant"])).engine.speculation == "auto"  # resolves off
    assert config_from_args(parse(["serve", "--speculation", "ngram"])).engine.speculation == "ngram"
    with pytest.raises(ConfigError, match="--speculation must be one of auto, off, ngram, not 'eagle'"):
        config_from_args(parse(["serve", "--speculation", "eagle"]))  # the one check: config.check_choices
    with pytest.raises(ConfigError, match="--speculation ngram needs --batch-invariant"):
        config_from_args(parse(["serve", "--speculation", "ngram", "--no-batch-invariant"]))
    with pytest.raises(ConfigError, match="--speculation must be one of auto, off, ngram"):
        EngineConfig(speculation="medusa").validate()
