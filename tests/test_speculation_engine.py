"""Speculative decoding changes no bit: the real engine on the tiny model, --speculation ngram against off.

Every comparison covers tokens, each token's logprob and top_logprobs, text, finish reason and usage. Each
case also asserts that drafts were made and accepted (and, where it matters, rejected), so that equality
is not the absence of speculation; and a TEST-ONLY broken verifier must make the same comparison fail.
A random tiny model settles into loops of its own tokens, which is what its drafts get accepted from.
"""

from __future__ import annotations

import os
import random

import pytest

from steadyserve.config import EngineConfig
from steadyserve.engine.engine import LLMEngine, _Emitted
from steadyserve.engine.offline import Completed, run_requests
from steadyserve.engine.sequence import Request, SamplingParams, Sequence
from steadyserve.engine.structured import json_schema_grammar
from steadyserve.models.loader import load_model

THREADS = int(os.environ.get("STEADYSERVE_TEST_THREADS", "1"))
PROMPTS = [[5, 17, 42, 99, 3] * 4, list(range(10, 50)) * 2, [7] * 12, [250, 11, 64, 64, 1], [100, 200, 300],
           [9, 8, 7, 6, 5, 4, 3, 2, 1] * 3]


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return load_model(tiny_model)


def make(loaded, mode: str, cheap_rows: int | None = None, **kw) -> LLMEngine:
    cfg = dict(kv_cache_memory=8 * 1024**2, threads=THREADS, max_num_batched_tokens=256, max_num_seqs=16,
               speculation=mode)
    cfg.update(kw)
    engine = LLMEngine(loaded, EngineConfig(**cfg))
    if cheap_rows is not None:  # let batches draft too (the tiny model's costs are not the point here)
        engine.speculator.cheap_rows = cheap_rows
    return engine


def requests(temperature: float = 0.0, max_tokens: int = 40, prompts=PROMPTS, **kw) -> list[Request]:
    kw.setdefault("ignore_eos", True)
    return [Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=temperature, logprobs=3,
                                               seed=1000 + i if temperature else None, **kw))
            for i, p in enumerate(prompts)]


def summary(c: Completed, cached: bool = True) -> tuple:
    usage = c.usage()
    if not cached:
        del usage["prompt_tokens_details"]
    return (c.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in c.logprobs], c.text, c.finish_reason,
            c.error, usage)


def differences(a: dict[str, Completed], b: dict[str, Completed], cached: bool = True) -> list[str]:
    """Requests whose results differ. `cached=False` leaves out usage's cached_tokens: what the prefix cache
    held at a request's latest admission, which depends on scheduling (preemption, what else ran, evictions),
    with or without speculation, and is no bit of what the model computed."""
    assert a.keys() == b.keys()
    return [rid for rid in a if summary(a[rid], cached) != summary(b[rid], cached)]


def one_by_one(engine: LLMEngine, reqs: list[Request]) -> dict[str, Completed]:
    done: dict[str, Completed] = {}
    for r in reqs:
        done.update(run_requests(engine, [r]))
    return done


def counts(engine: LLMEngine) -> tuple[int, int]:
    return engine.speculator.total_drafted, engine.speculator.total_accepted


def assert_speculated(engine: LLMEngine, rejections: bool = True) -> None:
    drafted, accepted = counts(engine)
    assert drafted > 0 and accepted > 0, (drafted, accepted)
    if rejections:
        assert accepted < drafted, "no draft was rejected: the rejection path went untested"


def greedy_and_seeded() -> list[Request]:
    """Greedy, seeded at a low temperature (drafts accepted) and at 1.0 with top-k/top-p (mostly rejected)."""
    reqs = requests(0.0) + requests(0.3) + requests(1.0, top_k=20, top_p=0.9)
    return [Request(f"{r.request_id}-{i // len(PROMPTS)}", r.prompt_token_ids, r.params) for i, r in enumerate(reqs)]


# ---- bitwise equality -------------------------------------------------------------------------------------

def test_greedy_and_seeded_sampling_alone_are_bitwise_those_of_off(loaded):
    on = make(loaded, "ngram")
    reqs = greedy_and_seeded()
    assert differences(one_by_one(make(loaded, "off"), reqs), one_by_one(on, reqs)) == []
    assert_speculated(on)


def test_concurrent_sequences_arriving_while_others_decode(loaded):
    reqs = greedy_and_seeded()
    arrivals = {3: reqs[6:10], 9: reqs[10:]}
    off = run_requests(make(loaded, "off"), reqs[:6], arrivals)
    on = make(loaded, "ngram", cheap_rows=24)
    assert differences(off, run_requests(on, reqs[:6], arrivals)) == []
    assert_speculated(on)
    # With the default cheap rows too (a batch this size drafts only as it drains).
    assert differences(off, run_requests(make(loaded, "ngram"), reqs[:6], arrivals)) == []


def record_verifications(engine: LLMEngine) -> list[tuple[int, int, str | None]]:
    """Wrap engine._verify: each verification's (draft tokens, tokens emitted, stop reason)."""
    seen: list[tuple[int, int, str | None]] = []
    real = engine._verify

    def verify(seq: Sequence, draft: list[int], result, emitted: _Emitted) -> str | None:
        reason = real(seq, draft, result, emitted)
        seen.append((len(draft), len(emitted.tokens), reason))
        return reason

    engine._verify = verify  # type: ignore[method-assign]
    return seen


def record_verifications(engine: LLMEngine) -> list[tuple[str, int, int, int, str | None]]:
    """Wrap engine._verify: each verification's (request id, tokens generated before it, draft tokens,
    tokens emitted, stop reason)."""
    seen: list[tuple[str, int, int, int, str | None]] = []
    real = engine._verify

    def verify(seq: Sequence, draft: list[int], result, emitted: _Emitted) -> str | None:
        before, reason = seq.num_generated_tokens, "error"
        try:
            reason = real(seq, draft, result, emitted)
        finally:
            seen.append((seq.request_id, before, len(draft), len(emitted.tokens), reason))
        return reason

    engine._verify = verify  # type: ignore[method-assign]
    return seen


def test_stop_tokens_stop_strings_and_max_tokens_inside_a_draft(loaded):
    # Free runs first, to find tokens first generated at an accepted draft position: as stop tokens, they
    # stop a verification with rows left after them.
    probe = make(loaded, "ngram")
    probe_seen = record_verifications(probe)
    bases = {r.request_id: r for r in requests(0.0) + requests(0.3)}
    free = one_by_one(probe, list(bases.values()))
    reqs = []
    for rid, before, drafted, emitted, _ in probe_seen:
        ids = free[rid].token_ids
        for q in range(before + 1, before + min(emitted, drafted)):  # accepted positions, rows left after them
            if ids[q] not in ids[:q]:
                params = dict(temperature=bases[rid].params.temperature, seed=bases[rid].params.seed, logprobs=2)
                reqs.append(Request(f"{rid}-tok{q}", bases[rid].prompt_token_ids, SamplingParams(
                    max_tokens=40, stop_token_ids=[ids[q]], ignore_eos=True, **params)))
                text = loaded.tokenizer.decode([ids[q]])
                if text.strip():
                    reqs.append(Request(f"{rid}-str{q}", bases[rid].prompt_token_ids, SamplingParams(
                        max_tokens=40, stop=[text.strip()], ignore_eos=True, **params)))
    assert reqs, "no token was first generated inside an accepted draft"
    for rid, base in bases.items():
        params = dict(temperature=base.params.temperature, seed=base.params.seed, logprobs=2)
        for n in (2, 3, 5, 8, 13):
            reqs.append(Request(f"{rid}-max{n}", base.prompt_token_ids, SamplingParams(
                max_tokens=n, ignore_eos=True, **params)))
        text = free[rid].text
        for a, b in ((6, 9), (12, 14)):  # stop strings from the text itself
            if text[a:b].strip():
                reqs.append(Request(f"{rid}-text{a}", base.prompt_token_ids, SamplingParams(
                    max_tokens=40, stop=[text[a:b]], ignore_eos=True, **params)))
    on = make(loaded, "ngram")
    seen = record_verifications(on)
    off, got = one_by_one(make(loaded, "off"), reqs), one_by_one(on, reqs)  # both with an empty prefix cache
    assert differences(off, got) == []
    assert_speculated(on)
    reasons = {c.finish_reason for c in off.values()}
    assert reasons == {"stop", "length"}, reasons
    # A stop inside a verification with rows left after it: those positions were discarded.
    assert any(reason == "stop" and emitted <= drafted for _, _, drafted, emitted, reason in seen), seen
    assert any(reason == "length" and drafted for _, _, drafted, _, reason in seen), seen


PROCESSORS = {"logit_bias": {"logit_bias": {5: 3.0, 17: -100.0, 221: 2.0}}, "presence": {"presence_penalty": 1.5},
              "frequency": {"frequency_penalty": 0.7}, "repetition": {"repetition_penalty": 1.3},
              "min_tokens": {"min_tokens": 12, "stop_token_ids": [119, 221], "ignore_eos": False},
              "grammar": {"grammar": json_schema_grammar({"type": "array", "items": {"type": "integer"}}),
                          "ignore_eos": False}}


def test_logits_processors_penalties_and_grammar_stay_exact(loaded):
    """They read the tokens emitted before each position, and the grammar advances over each emitted token
    in turn, so drafting stays on for them: a verification samples its positions one after another."""
    on = make(loaded, "ngram")
    off_engine = make(loaded, "off")
    for name, kw in PROCESSORS.items():
        reqs = [Request(f"{name}-{r.request_id}", r.prompt_token_ids, r.params) for r in
                requests(0.0, **kw)[:3] + requests(0.5, **kw)[:2]]
        assert differences(one_by_one(off_engine, reqs), one_by_one(on, reqs)) == [], name
    assert_speculated(on)


def test_preemption_under_speculation(loaded):
    # 6 blocks of 32 tokens for 6 sequences of up to 80 tokens: they must take turns.
    probe = make(loaded, "off")
    per_block = (probe.kv.k.numel() + probe.kv.v.numel()) * probe.kv.k.element_size() // probe.kv.num_blocks
    kw = dict(kv_cache_memory=6 * per_block)
    reqs = requests(0.0, max_tokens=40)[:3] + requests(0.3, max_tokens=40)[:3]
    reqs = [Request(f"{r.request_id}-{i}", r.prompt_token_ids, r.params) for i, r in enumerate(reqs)]
    off_engine, on = make(loaded, "off", **kw), make(loaded, "ngram", cheap_rows=24, **kw)
    assert on.kv.num_blocks == 6, on.kv.num_blocks
    # Preemption moves admissions, and with them what the prefix cache holds when a request is readmitted.
    assert differences(run_requests(off_engine, reqs), run_requests(on, reqs), cached=False) == []
    assert on.scheduler.num_preemptions > 0 and off_engine.scheduler.num_preemptions > 0
    assert_speculated(on, rejections=False)
    assert on.block_manager.num_free_blocks == on.kv.num_blocks


# ---- the prefix cache never keeps a rejected token ------------------------------------------------------

def _hashes_the_draft(self, seq, draft, result, emitted):
    """TEST-ONLY rollback bug: the block hashes are extended over the draft before it is verified, so a
    block a rejected token would have filled is published under the draft's hash."""
    full = Sequence(seq.seq_id, seq.request)
    full.token_ids = seq.token_ids + draft
    full.block_hashes = seq.block_hashes
    self.block_manager._prefix_hashes(full, full.num_tokens // self.block_manager.block_size)
    return _REAL_VERIFY(self, seq, draft, result, emitted)


@pytest.mark.parametrize("mode", ["invariant", "broken"])
def test_rejected_drafts_never_reach_the_prefix_cache(loaded, monkeypatch, mode):
    if mode == "broken":
        monkeypatch.setattr(LLMEngine, "_verify", _hashes_the_draft)
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
    strays = set(bm._cached) - chains
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

def _unchecked(self, seq, draft, result, emitted):
    """TEST-ONLY: takes every draft token without comparing it with the token sampled there."""
    reason = None
    try:
        for j, (row, argmax, has_nan) in enumerate(result.choice_rows()):
            tok = draft[j] if j < len(draft) else self._sample(seq, row, argmax, has_nan)
            reason = self._emit(seq, tok, row, emitted)
            if reason:
                break
    finally:
        self._count(seq, len(emitted.tokens))
        self.block_manager.truncate(seq)
        self.speculator.record(seq.state.drafter, len(draft), len(emitted.tokens) - 1)
    return reason


def _one_too_many(self, seq, draft, result, emitted):
    """TEST-ONLY off-by-one: at the first mismatch, keeps the draft token instead of the sampled one."""
    reason = None
    accepted = 0
    try:
        for j, (row, argmax, has_nan) in enumerate(result.choice_rows()):
            tok = self._sample(seq, row, argmax, has_nan)
            if j < len(draft) and tok != draft[j]:
                reason = self._emit(seq, draft[j], row, emitted)
                break
            reason = self._emit(seq, tok, row, emitted)
            if j == len(draft) or reason:
                break
            accepted += 1
    finally:
        self._count(seq, len(emitted.tokens))
        self.block_manager.truncate(seq)
        self.speculator.record(seq.state.drafter, len(draft), accepted)
    return reason


_REAL_VERIFY = LLMEngine._verify


def _one_draw_per_step(self, seq, draft, result, emitted):
    """TEST-ONLY: every position of a verification draws the same uniform (the generator is rewound before
    each), as if a step made one draw: greedy is unaffected, seeded sampling is not."""
    gen = seq.state.generator
    state = gen.get_state()
    real_sample = self._sample

    def rewound(*args):
        gen.set_state(state)
        return real_sample(*args)

    self._sample = rewound
    try:
        return _REAL_VERIFY(self, seq, draft, result, emitted)
    finally:
        del self._sample


@pytest.mark.parametrize("broken", [_unchecked, _one_too_many, _one_draw_per_step],
                         ids=["unchecked", "one_too_many", "one_draw_per_step"])
def test_a_broken_verifier_fails_the_equality_check(loaded, monkeypatch, broken):
    reqs = greedy_and_seeded()
    off = one_by_one(make(loaded, "off"), reqs)
    monkeypatch.setattr(LLMEngine, "_verify", broken)
    on = make(loaded, "ngram")
    got = one_by_one(on, reqs)
    assert counts(on)[0] > 0
    assert all(c.error is None for c in got.values())
    assert differences(off, got) != [], f"broken verifier {broken.__name__} went unnoticed"


# ---- metrics ---------------------------------------------------------------------------------------------

def test_step_stats_and_metrics_count_drafted_and_accepted_tokens(loaded):
    from steadyserve.metrics import Metrics

    on = make(loaded, "ngram")
    metrics = Metrics("m", "fp", "cpu", "float32", True)
    for r in requests(0.0)[:3]:
        on.add_request(r)
        while on.has_work():
            _, stats = on.step()
            metrics.on_step(stats)
    drafted, accepted = counts(on)
    assert drafted > 0 and accepted > 0
    reg = metrics.registry
    assert reg.get_sample_value("steadyserve_speculation_drafted_tokens_total") == drafted
    assert reg.get_sample_value("steadyserve_speculation_accepted_tokens_total") == accepted
    assert reg.get_sample_value("steadyserve_speculation_acceptance_ratio_count") > 0
    assert reg.get_sample_value("steadyserve_speculation_acceptance_ratio_bucket", {"le": "1.0"}) == \
        reg.get_sample_value("steadyserve_speculation_acceptance_ratio_count")


def test_off_is_the_default_and_drafts_nothing(loaded):
    assert EngineConfig().speculation == "off"
    off = make(loaded, "off")
    run_requests(off, requests(0.0)[:2])
    assert counts(off) == (0, 0) and not off.speculator.enabled


def test_random_prompts_many_seeds(loaded):
    """A wider net: random prompts with repeats spliced in, several seeds and lengths, all at once."""
    rng = random.Random(11)
    reqs = []
    for i in range(12):
        base = [rng.randrange(300) for _ in range(rng.randrange(3, 12))]
        prompt = base * rng.randrange(1, 4) + [rng.randrange(300) for _ in range(rng.randrange(0, 5))]
        reqs.append(Request(f"x{i}", prompt, SamplingParams(
            max_tokens=rng.randrange(1, 50), temperature=rng.choice([0, 0, 0.2, 0.7]), seed=i, top_p=0.95,
            logprobs=rng.choice([None, 0, 2]), ignore_eos=rng.choice([True, False]))))
    off = run_requests(make(loaded, "off"), reqs)
    on = make(loaded, "ngram", cheap_rows=32)
    assert differences(off, run_requests(on, reqs)) == []
    assert_speculated(on, rejections=False)


def test_the_selftest_passes_with_speculation_on(loaded):
    from steadyserve.engine.selftest import run_selftest

    result = run_selftest(make(loaded, "ngram"))
    assert result.passed, result.detail


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


def test_inter_token_latency_counts_every_token_of_a_verification():
    from steadyserve.engine.sequence import RequestOutput
    from steadyserve.metrics import Metrics

    m = Metrics("m", "fp", "cpu", "float32", True)
    m.on_output(RequestOutput("a", [1], "x", []), arrival=0.0)  # the first token: TTFT
    m.on_output(RequestOutput("a", [2, 3, 4], "yzw", []), arrival=0.0)  # one verification, 3 tokens
    reg = m.registry
    assert reg.get_sample_value("steadyserve_inter_token_latency_seconds_count") == 3
    assert reg.get_sample_value("steadyserve_inter_token_latency_seconds_bucket", {"le": "0.001"}) >= 2


def test_host_numerics_too(tiny_model):
    """--numerics host (float32 weights, MKL, calibrated row counts): chunks are as exact there."""
    from steadyserve.engine.selftest import run_selftest

    host = load_model(tiny_model, numerics="host")
    assert not host.model.native and host.model.tiler.enabled
    off = make(host, "off")
    assert run_selftest(off).passed  # calibrates the row counts, as the server does at start-up
    on = make(host, "ngram")
    reqs = requests(0.0)[:4] + requests(0.3)[:4]
    reqs = [Request(f"{r.request_id}-{i}", r.prompt_token_ids, r.params) for i, r in enumerate(reqs)]
    assert differences(one_by_one(off, reqs), one_by_one(on, reqs)) == []
    assert_speculated(on, rejections=False)


def test_a_nan_inside_a_draft_fails_the_request_after_the_same_tokens(loaded):
    """A NaN in the row of generated token K: off emits tokens 0..K-1 over earlier steps then fails; a
    verification that reaches row K emits what came before it in its error output: the same in all."""
    K = 9

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
    # The NaN row was a draft row of a verification, not its first.
    assert any(rid == "r0" and before < K <= before + drafted for rid, before, drafted, _, _ in seen), seen
