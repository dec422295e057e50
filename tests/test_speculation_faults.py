"""Speculation's failure modes, on the tiny model: the prefix cache never keeps a rejected token (and a stale
draft hash is caught), TEST-ONLY broken verifiers fail the equality check, a NaN inside a draft fails the
request after the same tokens as without speculation, and an abort frees every block."""

from __future__ import annotations

import pytest

from steadyserve.engine.batch_sampler import BatchSampler, Sampled
from steadyserve.engine.engine import LLMEngine
from steadyserve.engine.offline import run_requests
from steadyserve.engine.scheduler import Scheduler
from steadyserve.engine.sequence import Request, SamplingParams, Sequence
from steadyserve.models.loader import load_model

from speculation_util import (assert_speculated, counts, differences, greedy_and_seeded, make, one_by_one,
                              record_verifications, requests)


_REAL_CHOOSE = BatchSampler._choose  # before any test patches the classes
_REAL_UPDATE = Scheduler.update


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return load_model(tiny_model)


# ---- the prefix cache never keeps a rejected token ------------------------------------------------------

def _hashes_the_draft(self, batch, outputs):
    """TEST-ONLY rollback bug: the block hashes are extended over the draft before it is settled, so a
    block a rejected token would have filled is published under the draft's hash."""
    for item in batch.scheduled:
        seq = item.seq
        if seq.draft_token_ids:
            full = Sequence(seq.seq_id, seq.request)
            full.token_ids = seq.token_ids + seq.draft_token_ids
            full.block_hashes = seq.block_hashes
            self.block_manager._prefix_hashes(full, full.num_tokens // self.block_manager.block_size)
    return _REAL_UPDATE(self, batch, outputs)


@pytest.mark.parametrize("mode", ["invariant", "broken"])
def test_rejected_drafts_never_reach_the_prefix_cache(loaded, monkeypatch, mode):
    if mode == "broken":
        monkeypatch.setattr(Scheduler, "update", _hashes_the_draft)
    bs = 16
    on = make(loaded, "ngram", block_size=bs)
    reqs = greedy_and_seeded()
    for t in (0.4, 0.6, 0.8):  # more rejections, some in a block the draft would have filled
        reqs += [Request(f"{r.request_id}-t{t}", r.prompt_token_ids, r.params) for r in requests(t, max_tokens=60)]
    first = one_by_one(on, reqs)
    assert_speculated(on)
    bm = on.block_manager
    # Every cached block's hash is a prefix of some request's final tokens (prompt + accepted output) ...
    chains: set[bytes] = set()
    for r in reqs:
        full = Sequence(0, Request("x", r.prompt_token_ids + first[r.request_id].token_ids, r.params))
        chains.update(bm._prefix_hashes(full, full.num_tokens // bs))
    strays = {h for _, h in bm._cached} - chains  # keyed by (group, hash)
    if mode == "broken":
        assert strays, "blocks published under draft tokens' hashes went unnoticed"
        return
    assert bm.num_cached_blocks > 0 and not strays
    # ... and holds exactly the K/V a fresh engine computes for it: requests resuming from those prefixes
    # get cache hits here and bitwise the results of an engine without a prefix cache.
    later = []
    for r in reqs:
        out = first[r.request_id].token_ids
        later.append(Request(f"{r.request_id}-again", r.prompt_token_ids + out[:len(out) - 3],
                             SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True)))
    fresh = one_by_one(make(loaded, "off", block_size=bs, prefix_caching=False), later)
    again = one_by_one(on, later)
    assert sum(c.num_cached_tokens for c in again.values()) > 0
    assert differences(fresh, again, cached=False) == []


# ---- a broken verifier is caught ------------------------------------------------------------------------

def _unchecked(self, seq, result):
    """TEST-ONLY: takes every draft token without comparing it with the token sampled there."""
    draft = seq.draft_token_ids
    if not draft:
        return _REAL_CHOOSE(self, seq, result)
    out = Sampled()
    for j, (row, argmax, has_nan) in enumerate(result.choice_rows()):
        out.tokens.append(draft[j] if j < len(draft) else self._pick(seq, out.tokens, row, argmax, has_nan))
        out.rows.append(row)
    return out


def _one_too_many(self, seq, result):
    """TEST-ONLY off-by-one: at the first mismatch, keeps the draft token instead of the sampled one."""
    out = _REAL_CHOOSE(self, seq, result)
    draft, j = seq.draft_token_ids, len(out.tokens) - 1
    if out.error is None and 0 <= j < len(draft) and out.tokens[j] != draft[j]:
        out.tokens[j] = draft[j]
    return out


def _one_draw_per_step(self, seq, result):
    """TEST-ONLY: every position of a verification draws the same uniform (the generator is rewound before
    each), as if a step made one draw: greedy is unaffected, seeded sampling is not."""
    if not seq.draft_token_ids:
        return _REAL_CHOOSE(self, seq, result)
    gen = seq.state.generator
    state = gen.get_state()
    real_pick = self._pick

    def rewound(*args):
        gen.set_state(state)
        return real_pick(*args)

    self._pick = rewound
    try:
        return _REAL_CHOOSE(self, seq, result)
    finally:
        del self._pick


@pytest.mark.parametrize("broken", [_unchecked, _one_too_many, _one_draw_per_step],
                         ids=["unchecked", "one_too_many", "one_draw_per_step"])
def test_a_broken_verifier_fails_the_equality_check(loaded, monkeypatch, broken):
    reqs = greedy_and_seeded()
    off = one_by_one(make(loaded, "off"), reqs)
    monkeypatch.setattr(BatchSampler, "_choose", broken)
    on = make(loaded, "ngram")
    got = one_by_one(on, reqs)
    assert counts(on)[0] > 0
    assert all(c.error is None for c in got.values())
    assert differences(off, got) != [], f"broken verifier {broken.__name__} went unnoticed"


def test_abort_mid_generation_frees_every_block(loaded):
    on = make(loaded, "ngram", cheap_rows=8)
    for r in requests(0.0, max_tokens=60)[:3]:
        on.add_request(r)
    multi = 0
    for _ in range(12):
        outs, _ = on.step()
        multi += sum(len(o.new_token_ids) > 1 for o in outs)  # a verification's tokens arrive together
    assert multi > 0
    for r in requests(0.0)[:3]:
        out = on.abort_request(r.request_id)
        assert out is not None and out.finish_reason == "abort"
    assert not on.has_work() and on.block_manager.num_free_blocks == on.block_manager.num_blocks


def test_a_nan_inside_a_draft_fails_the_request_after_the_same_tokens(loaded):
    """A NaN in the row of generated token K: off emits tokens 0..K-1 over earlier steps then fails; a
    verification that reaches row K emits what came before it in its error output: the same in all. K is
    the last token of r0's first verification that emitted 2 or more, in a clean run: the row picking it is a
    draft row, and the verification reaches it (how many tokens one drafts is the speculator's choice)."""
    clean = make(loaded, "ngram", cheap_rows=16)
    verified = record_verifications(clean)
    run_requests(clean, requests(0.0)[:3])
    K = next(before + emitted - 1 for rid, before, _, emitted, _ in verified if rid == "r0" and emitted >= 2)

    def poison(engine: LLMEngine) -> None:
        real = engine.runner.execute

        def execute(sched):
            results = real(sched)
            for item, r in zip(sched.scheduled, results):
                if item.seq.request_id != "r0" or r.sample_row is None:
                    continue
                rows = [r.sample_row, *r.draft_rows]
                j = K - item.seq.num_generated_tokens  # the row that picks generated token K
                if 0 <= j < len(rows):
                    row = rows[j] = rows[j].clone()
                    row[(int(row.argmax()) + 1) % row.shape[0]] = float("nan")
                    if j == 0:
                        r.sample_row, r.sample_has_nan = row, True
                    else:
                        r.draft_rows[j - 1], r.draft_has_nan[j - 1] = row, True
            return results

        engine.runner.execute = execute  # type: ignore[method-assign]

    off_engine, on = make(loaded, "off"), make(loaded, "ngram", cheap_rows=16)
    poison(off_engine)
    poison(on)
    seen = record_verifications(on)
    reqs = requests(0.0)[:3]  # r0 first: the oldest drafts first
    off, got = run_requests(off_engine, reqs), run_requests(on, reqs)
    assert off["r0"].finish_reason == "error" and "NaN" in off["r0"].error and len(off["r0"].token_ids) == K
    assert differences(off, got) == []
    # The NaN row was a draft row of a verification, not its first, and the verification reached it.
    assert any(rid == "r0" and before < K <= before + drafted and reason == "error"
               for rid, before, drafted, _, reason in seen), seen
