"""Sharing a step's token budget between tenants (fair_share.split_step) never changes a request's bits.

Two tenants of weights 3 and 1 (one `batch`) send long prompts to an engine with a 64-token step budget, so
their prompts are computed in chunks sized by the split; each request's tokens and logprobs (prompt and
generated) are compared bitwise with the same request computed alone. The `broken` variant installs a TEST-ONLY
batch drift: the same comparison then finds a difference, so the check has teeth.
"""

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
from steadyserve.testing.drift import install_batch_drift

THREADS = int(os.environ.get("STEADYSERVE_TEST_THREADS", "1"))


@pytest.fixture(scope="module")
def engine(smolwidth_model):
    loaded = load_model(smolwidth_model, batch_invariant=True, row_tile=64)
    eng = LLMEngine(loaded, EngineConfig(kv_cache_memory=64 * 1024**2, threads=THREADS, max_num_batched_tokens=64,
                                         max_num_seqs=8, batch_invariant=True))
    result = run_selftest(eng)
    assert result.passed, result.detail
    return eng


def requests(vocab: int) -> list[Request]:
    rng = random.Random(61)
    out = []
    for i in range(6):
        tenant, share, batch = ("three", 3.0, False) if i % 2 else ("one", 1.0, True)
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(90, 160))]  # longer than a step's budget
        out.append(Request(f"{tenant}{i}", prompt, SamplingParams(max_tokens=6, temperature=0, logprobs=0,
                                                                  prompt_logprobs=0, ignore_eos=True),
                           tenant=tenant, share=share, batch=batch))
    return out


def fresh(r: Request) -> Request:
    return Request(r.request_id, list(r.prompt_token_ids), r.params, tenant=r.tenant, share=r.share, batch=r.batch)


def diff(a: Completed, b: Completed) -> float:
    if a.token_ids != b.token_ids:
        return float("inf")
    pairs = list(zip(a.logprob_values, b.logprob_values)) + list(zip(a.prompt_logprob_values, b.prompt_logprob_values))
    return max((abs(x - y) for x, y in pairs), default=0.0)


@pytest.mark.parametrize("name", ["invariant", "broken"])
def test_a_tenant_shared_step_keeps_every_requests_bits(engine, name, monkeypatch):
    reqs = requests(engine.loaded.args.vocab_size)
    alone = {r.request_id: run_requests(engine, [fresh(r)])[r.request_id] for r in reqs}
    sched = engine.scheduler
    shared_steps = []
    real = sched._prefill_caps

    def counting(budget: int):
        caps = real(budget)
        shared_steps.append(caps is not None)
        return caps

    monkeypatch.setattr(sched, "_prefill_caps", counting)
    restore = install_batch_drift(engine) if name == "broken" else None
    try:
        together = run_requests(engine, [fresh(r) for r in reqs])
    finally:
        if restore is not None:
            restore()
    assert sum(shared_steps) >= 5, shared_steps  # the split really sized the chunks
    diffs = {rid: diff(together[rid], alone[rid]) for rid in alone}
    print(f"\n{name}: max |logprob diff| per request: {diffs}")
    if name == "invariant":
        assert all(d == 0.0 for d in diffs.values()), diffs
    else:
        assert any(d != 0.0 for d in diffs.values()), diffs


def test_a_sequence_preempted_for_a_seat_keeps_its_bits(engine, monkeypatch):
    """Equal shares, 4 seats: A's 4 requests hold them; B's first request (nothing of B running) and its second
    (B below its 2 seats) are each seated at once in place of A's newest (engine/seating.py), which is recomputed
    later. Every request's tokens and logprobs are bitwise those computed alone. (With only a tenant with nothing
    running seated at once, B1 waits until B0 is done, then takes A3's seat a second time: the first assertion
    fails.)"""
    rng = random.Random(62)
    vocab = engine.loaded.args.vocab_size

    def make(name: str, tenant: str, max_tokens: int) -> Request:
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(20, 40))]
        return Request(name, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0,
                                                    ignore_eos=True), tenant=tenant)

    a = [make(f"A{i}", "A", 160) for i in range(4)]
    b = {4: [make("B0", "B", 100)], 10: [make("B1", "B", 8)]}  # B0 still runs when B1 comes, drafts or not
    alone = {r.request_id: run_requests(engine, [fresh(r)])[r.request_id] for r in [*a, *b[4], *b[10]]}
    sched = engine.scheduler
    monkeypatch.setattr(sched, "max_num_seqs", 4)
    preempted = []  # (victim, whether B0 was running then)
    real = sched._preempt

    def recording(seq, out):
        preempted.append((seq.request.request_id, any(s.request.request_id == "B0" for s in sched.running)))
        real(seq, out)

    monkeypatch.setattr(sched, "_preempt", recording)
    together = run_requests(engine, [fresh(r) for r in a], {k: [fresh(r) for r in v] for k, v in b.items()})
    assert preempted == [("A3", False), ("A2", True)], preempted
    diffs = {rid: diff(together[rid], alone[rid]) for rid in alone}
    assert all(d == 0.0 for d in diffs.values()), diffs
