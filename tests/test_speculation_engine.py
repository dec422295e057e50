"""Speculative decoding changes no bit: the real engine on the tiny model, --speculation ngram against off.

Every comparison covers tokens, each token's logprob and top_logprobs, text, finish reason and usage. Each
case also asserts that drafts were made and accepted (and, where it matters, rejected), so that equality
is not the absence of speculation (test_speculation_faults.py shows TEST-ONLY broken verifiers failing the
same comparison). A random tiny model settles into loops of its own tokens, which its drafts copy.
"""

from __future__ import annotations

import random

import pytest
import torch

from steadyserve.config import EngineConfig
from steadyserve.engine.offline import run_requests
from steadyserve.engine.sequence import Request, SamplingParams
from steadyserve.engine.structured import json_schema_grammar
from steadyserve.models.loader import load_model

from speculation_util import (PROMPTS, assert_speculated, counts, differences, greedy_and_seeded, make, one_by_one,
                              record_verifications, requests)


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return load_model(tiny_model)


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
    default = make(loaded, "ngram")
    assert differences(off, run_requests(default, reqs[:6], arrivals)) == []
    assert counts(default)[0] > 0, "the default engine never drafted: the comparison was off against off"


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
        drafted_before = counts(on)[0]
        assert differences(one_by_one(off_engine, reqs), one_by_one(on, reqs)) == [], name
        # Each processor's own requests drafted (drafting stays on for it). Whether a draft is kept depends on
        # it: a presence penalty pushes the copied tokens down, so its drafts are all rejected here.
        assert counts(on)[0] > drafted_before, name
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


def test_off_drafts_nothing(loaded):
    off = make(loaded, "off")
    run_requests(off, requests(0.0)[:2])
    assert counts(off) == (0, 0) and not off.speculator.enabled


def test_auto_the_default_speculates_exactly_where_exactness_holds(loaded):
    """auto: ngram on the batch-invariant native path (the tiny model runs it), off without batch invariance
    or without spare register rows (the scalar build's 1)."""
    assert EngineConfig().speculation == "auto"
    auto = make(loaded, "auto")
    assert auto.speculator.enabled and auto.speculator.cheap_rows == torch.ops.steadyserve.qmm_register_rows() > 1
    run_requests(auto, requests(0.0)[:2])
    assert_speculated(auto, rejections=False)
    assert not make(loaded, "auto", batch_invariant=False).speculator.enabled
    assert make(loaded, "ngram").speculator.enabled


def test_the_lookup_keys_come_from_the_tokenizers_text(loaded):
    """The engine's n-gram keys (speculation.TokenKeys) join ids whose text, read from the model's own
    tokenizer, differs only in case and the space around it: "A", "a", " a" and " A" are one key."""
    tok = loaded.tokenizer
    keys = make(loaded, "ngram").speculator.keys
    a_ids = [tok.convert_tokens_to_ids(t) for t in ("A", "a", "\u0120a", "\u0120A")]  # byte-level BPE: \u0120 is a space
    assert [tok.decode([i]) for i in a_ids] == ["A", "a", " a", " A"]
    assert len({keys(i) for i in a_ids}) == 1
    b_ids = [tok.convert_tokens_to_ids(t) for t in ("B", "b", "\u0120b")]
    assert len({keys(i) for i in b_ids}) == 1 and keys(b_ids[0]) != keys(a_ids[0])
    space, newline = (tok.convert_tokens_to_ids(t) for t in ("\u0120", "\u010a"))
    assert len({keys(space), keys(newline), keys(a_ids[0])}) == 3  # whitespace tokens keep their own keys


def test_auto_is_off_where_the_kernels_have_one_register_row(loaded, monkeypatch):
    from steadyserve.engine import engine as engine_module

    monkeypatch.setattr(engine_module, "_cheap_rows", lambda model: 1)  # the scalar build's
    assert not make(loaded, "auto").speculator.enabled
    assert make(loaded, "ngram").speculator.enabled  # asked for explicitly: it runs (exact, not faster)


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


def test_sliding_window_blocks_released_under_drafts(models_dir):
    """The tiny Phi-3 (a window of 24 on every layer): blocks leave the window while drafts run past it."""
    from steadyserve.testing import build_tiny_model

    d = models_dir / "tiny-phi3"
    if not d.exists():
        build_tiny_model(d, arch="phi3")
    phi3 = load_model(str(d), max_model_len=512)
    reqs = [Request(f"w{i}", p * 3, SamplingParams(max_tokens=120, temperature=t, seed=i, logprobs=1, ignore_eos=True))
            for i, (p, t) in enumerate([([3, 1, 4, 1, 5], 0.0), ([9, 2, 6], 0.0), ([2, 7, 1, 8], 0.3)])]
    kw = dict(block_size=16, kv_cache_memory=16 * 1024**2)
    off = make(phi3, "off", **kw)
    on = make(phi3, "ngram", **kw)
    assert on.block_manager.windows == (24,)
    assert differences(one_by_one(off, reqs), one_by_one(on, reqs)) == []
    assert_speculated(on, rejections=False)
    assert on.block_manager.num_free_blocks == on.kv.num_blocks


def test_prompt_and_max_tokens_filling_the_context(loaded):
    """Drafts near the end of the context: prompt + max_tokens == max_model_len."""
    ctx = 96
    reqs = [Request(f"c{i}", p[:40], SamplingParams(max_tokens=ctx - len(p[:40]), temperature=t, seed=3,
                                                     logprobs=0, ignore_eos=True))
            for i, (p, t) in enumerate([(PROMPTS[0] * 2, 0.0), (PROMPTS[2] * 4, 0.0), (PROMPTS[1], 0.3)])]
    off, on = make(loaded, "off", max_model_len=ctx), make(loaded, "ngram", max_model_len=ctx)
    got = one_by_one(on, reqs)
    assert differences(one_by_one(off, reqs), got) == []
    assert all(c.finish_reason == "length" and c.num_prompt_tokens + c.num_generated_tokens == ctx
               for c in got.values())
    assert_speculated(on, rejections=False)


def test_a_failed_selftest_turns_speculation_off_whatever_was_asked(loaded):
    """One owner of the decision (engine._speculation_mode, applied by LLMEngine.settle_speculation after the
    start-up self-test): an engine whose self-test fails (a TEST-ONLY batch drift) drafts nothing, auto or ngram;
    one whose self-test passes keeps the mode it was given."""
    from steadyserve.engine.selftest import run_selftest
    from steadyserve.testing.drift import install_batch_drift

    for mode in ("auto", "ngram"):
        engine = make(loaded, mode)
        assert engine.speculator.enabled  # provisional: the self-test runs with it
        restore = install_batch_drift(engine)
        try:
            result = run_selftest(engine)
            assert not result.passed, result.detail
            assert engine.settle_speculation(result.passed) is False and not engine.speculator.enabled
            before = counts(engine)
            run_requests(engine, requests(0.0)[:2])
            assert counts(engine) == before, mode  # no draft
        finally:
            restore()
    passing = make(loaded, "auto")
    result = run_selftest(passing)
    assert result.passed and passing.settle_speculation(result.passed) and passing.speculator.enabled
