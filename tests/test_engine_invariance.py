"""Batch invariance of the engine, bitwise, on SmolLM2-width layers (where plain F.linear rows vary
with the row count). Each invariance test also runs with batch invariance off and must see a difference:
the tests have teeth."""

from __future__ import annotations

import os
import random

import pytest

from steadyserve.config import EngineConfig
from steadyserve.engine.engine import LLMEngine
from steadyserve.engine.offline import Completed, run_requests
from steadyserve.engine.selftest import run_selftest
from steadyserve.engine.sequence import Request, SamplingParams
from steadyserve.models.loader import load_model

THREADS = int(os.environ.get("STEADYSERVE_TEST_THREADS", "1"))
KV = 64 * 1024**2
BATCHES = [2, 7, 33, 64]


def engine_for(loaded, **kw) -> LLMEngine:
    cfg = dict(kv_cache_memory=KV, threads=THREADS, max_num_batched_tokens=512, max_num_seqs=64,
               batch_invariant=loaded.model.tiler.enabled)
    cfg.update(kw)
    return LLMEngine(loaded, EngineConfig(**cfg))


@pytest.fixture(scope="module")
def bi(smolwidth_model):
    loaded = load_model(smolwidth_model, batch_invariant=True, row_tile=64)
    engine = engine_for(loaded)
    result = run_selftest(engine)  # calibrates the tile ladder, as the server does at start-up
    assert result.passed, result.detail
    return engine


@pytest.fixture(scope="module")
def plain(smolwidth_model):
    return engine_for(load_model(smolwidth_model, batch_invariant=False, row_tile=64))


@pytest.fixture(params=["invariant", "plain"])
def mode(request, bi, plain):
    return request.param, (bi if request.param == "invariant" else plain)


def greedy(rid: str, prompt: list[int], n: int, **kw) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=n, temperature=0, logprobs=0, prompt_logprobs=0,
                                               ignore_eos=True, **kw))


def others(rng: random.Random, vocab: int, k: int, prefix: str = "o") -> list[Request]:
    return [Request(f"{prefix}{i}", [rng.randrange(vocab) for _ in range(rng.randrange(2, 48))],
                    SamplingParams(max_tokens=rng.randrange(1, 12), temperature=rng.choice([0, 0.8]),
                                   logprobs=rng.choice([None, 0, 3]), ignore_eos=True))
            for i in range(k)]


def same(a: Completed, b: Completed) -> bool:
    return (a.token_ids == b.token_ids and a.logprob_values == b.logprob_values
            and a.prompt_logprob_values == b.prompt_logprob_values)


def max_diff(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def expect(mode: str, diffs: dict[str, float]) -> None:
    """Invariant: every comparison bitwise equal. Plain: at least one differs (the test can fail)."""
    print(f"\n{mode}: max |logprob diff| per case: " + ", ".join(f"{k}={v:.3g}" for k, v in diffs.items()))
    if mode == "invariant":
        assert all(v == 0.0 for v in diffs.values()), diffs
    else:
        assert any(v != 0.0 for v in diffs.values()), f"batch invariance off, yet no difference: {diffs}"


def test_probe_alone_vs_inside_batches(mode):
    name, engine = mode
    vocab = engine.loaded.args.vocab_size
    rng = random.Random(7)
    prompt = [rng.randrange(vocab) for _ in range(37)]  # crosses a 32-token KV block
    alone = run_requests(engine, [greedy("probe", prompt, 10)])["probe"]
    assert len(alone.token_ids) == 10 and len(alone.prompt_logprob_values) == 36
    diffs = {}
    for k in BATCHES:
        other = others(rng, vocab, k)
        pos = rng.randrange(k + 1)  # a random batch position ...
        arrive = rng.choice([0, 1, 2, 3])  # ... arriving at once or while the others decode (mixed steps)
        probe = greedy("probe", prompt, 10)
        if arrive == 0:
            done = run_requests(engine, other[:pos] + [probe] + other[pos:])
        else:
            done = run_requests(engine, other[:pos], {arrive: [probe] + other[pos:]})
        got = done["probe"]
        assert all(c.finish_reason == "length" for c in done.values())
        if name == "invariant":
            assert same(got, alone), f"batch of {k}: probe differs"
        d = max(max_diff(got.logprob_values, alone.logprob_values),
                max_diff(got.prompt_logprob_values, alone.prompt_logprob_values))
        diffs[f"batch{k}"] = d if got.token_ids == alone.token_ids else float("inf")
    expect(name, diffs)


def test_score_equals_generation_logprobs(mode):
    """score(prompt + completion) gives the completion exactly the logprobs it got while generated."""
    name, engine = mode
    vocab = engine.loaded.args.vocab_size
    rng = random.Random(11)
    diffs = {}
    for plen, gen in ((5, 12), (40, 16)):
        prompt = [rng.randrange(vocab) for _ in range(plen)]
        g = run_requests(engine, [greedy("g", prompt, gen)])["g"]
        s = run_requests(engine, [Request("s", prompt + g.token_ids,
                                          SamplingParams(max_tokens=0, prompt_logprobs=0))])["s"]
        assert s.finish_reason == "length" and len(s.prompt_logprob_values) == plen + gen - 1
        assert s.prompt_logprob_values[:plen - 1] == g.prompt_logprob_values
        if name == "invariant":
            assert s.prompt_logprob_values[-gen:] == g.logprob_values
        diffs[f"prompt{plen}+{gen}"] = max_diff(s.prompt_logprob_values[-gen:], g.logprob_values)
    expect(name, diffs)


def test_chunked_prefill_equals_whole_prefill(mode):
    name, engine = mode
    chunked = engine_for(engine.loaded, max_num_batched_tokens=7, max_num_seqs=4)
    vocab = engine.loaded.args.vocab_size
    rng = random.Random(3)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (45, 9, 70)]

    def reqs() -> list[Request]:
        return [greedy(f"c{i}", p, 6) for i, p in enumerate(prompts)]

    whole = run_requests(engine, reqs())
    steps = {}
    done: dict[str, Completed] = {r.request_id: Completed() for r in reqs()}
    for r in reqs():
        chunked.add_request(r)
    while chunked.has_work():
        outs, stats = chunked.step()
        assert stats.num_tokens <= 7
        steps[stats.num_tokens] = steps.get(stats.num_tokens, 0) + 1
        for o in outs:
            done[o.request_id].add(o)
    diffs = {}
    for rid, w in whole.items():
        c = done[rid]
        if name == "invariant":
            assert same(c, w), f"{rid}: chunked prefill changed the result"
        diffs[rid] = max(max_diff(c.prompt_logprob_values, w.prompt_logprob_values),
                         max_diff(c.logprob_values, w.logprob_values)) if c.token_ids == w.token_ids else float("inf")
    assert max(steps) == 7 and sum(steps.values()) > 10, steps  # prompts really were chunked
    expect(name, diffs)


def test_preemption_does_not_change_results(bi):
    vocab = bi.loaded.args.vocab_size
    rng = random.Random(21)
    reqs = [greedy(f"p{i}", [rng.randrange(vocab) for _ in range(rng.randrange(20, 40))], 24) for i in range(8)]
    reqs.append(Request("seeded", reqs[0].prompt_token_ids, SamplingParams(
        max_tokens=24, temperature=0.9, top_p=0.95, seed=99, logprobs=0, ignore_eos=True)))
    ref = {r.request_id: run_requests(bi, [r])[r.request_id] for r in reqs}
    # 10 blocks of 32 tokens for 9 sequences of up to 64 tokens: they must take turns.
    small = engine_for(bi.loaded, kv_cache_memory=10 * 2 * 2 * 3 * 64 * 32 * 4)
    assert small.kv.num_blocks == 10
    done = run_requests(small, reqs)
    assert small.scheduler.num_preemptions > 0, "the test needs preemptions"
    for rid, c in done.items():
        assert c.finish_reason == "length"
        assert same(c, ref[rid]), f"{rid} changed under preemption"
    assert small.block_manager.num_free_blocks == 10


def test_seeded_sampling_alone_and_under_load(bi):
    vocab = bi.loaded.args.vocab_size
    rng = random.Random(5)
    prompt = [rng.randrange(vocab) for _ in range(20)]

    def probe():
        return Request("seeded", prompt, SamplingParams(max_tokens=20, temperature=1.0, top_k=50, top_p=0.9,
                                                        seed=1234, logprobs=2, ignore_eos=True))
    alone = run_requests(bi, [probe()])["seeded"]
    again = run_requests(bi, [probe()])["seeded"]
    assert alone.token_ids == again.token_ids
    loaded = run_requests(bi, others(rng, vocab, 5), {1: [probe()], 2: others(rng, vocab, 20, "p")})["seeded"]
    assert loaded.token_ids == alone.token_ids and loaded.logprob_values == alone.logprob_values
    assert [lp.top for lp in loaded.logprobs] == [lp.top for lp in alone.logprobs]
    other_seed = run_requests(bi, [Request("s2", prompt, SamplingParams(max_tokens=20, temperature=1.0,
                                                                        seed=4321, ignore_eos=True))])["s2"]
    assert other_seed.token_ids != alone.token_ids  # the seed matters


def test_selftest_passes_invariant_and_fails_plain(bi, plain):
    ok = run_selftest(bi)
    assert ok.passed, ok.detail
    bad = run_selftest(plain)
    print(f"\nself-test invariant: {ok.detail}\nself-test plain: {bad.detail}")
    assert not bad.passed and "batch variance detected" in bad.detail
