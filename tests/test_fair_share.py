"""Fair share between tenants in the scheduler (engine/fair_share.py): deficit round-robin by weight over the
tokens a sequence may compute, strict priority between classes, FIFO for one tenant; pure Python (no torch)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

from steadyserve.engine.block_manager import BlockManager
from steadyserve.engine.fair_share import FairShare, cost
from steadyserve.engine.scheduler import Scheduler, SchedulerOutput
from steadyserve.engine.sequence import Request, SamplingParams, Sequence

_ids = iter(range(10**9))


def seq(tenant: str, prompt_len: int = 8, max_tokens: int = 8, share: float = 1.0, batch: bool = False) -> Sequence:
    i = next(_ids)
    return Sequence(i, Request(f"{tenant}-{i}", list(range(prompt_len)), SamplingParams(max_tokens=max_tokens),
                               tenant=tenant, share=share, batch=batch))


def step(sched: Scheduler) -> tuple[SchedulerOutput, list[Sequence]]:
    """One step as the engine runs it (test_scheduler.advance): compute, sample a token, retire finished."""
    out = sched.schedule()
    done = []
    for item in out.scheduled:
        s = item.seq
        s.num_computed_tokens += item.num_new_tokens
        sched.block_manager.cache_full_blocks(s, item.num_new_tokens)
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(7)
            if s.num_generated_tokens >= s.params.max_tokens:
                sched.retire(s)
                done.append(s)
    return out, done


def admissions(sched: Scheduler, steps: int, refill: dict[str, tuple[float, int]] | None = None,
               tokens: Counter | None = None) -> list[str]:
    """The tenant of each sequence admitted over `steps` steps, in order. `refill`: tenant -> (share, backlog):
    keep that many of its sequences waiting (a flood that never lets up). `tokens`: counts each tenant's
    generated tokens."""
    order = []
    for _ in range(steps):
        for tenant, (share, backlog) in (refill or {}).items():
            while sum(1 for s in sched.waiting if s.request.tenant == tenant) < backlog:
                sched.add(seq(tenant, share=share))
        waiting = {id(s) for s in sched.waiting}
        out, _ = step(sched)
        order += [i.seq.request.tenant for i in out.scheduled if id(i.seq) in waiting]
        if tokens is not None:
            tokens.update(i.seq.request.tenant for i in out.scheduled
                          if i.seq.num_computed_tokens >= i.seq.num_prompt_tokens)
    return order


def test_fair_share_imports_no_torch() -> None:
    code = ("import sys\nimport steadyserve.engine.fair_share, steadyserve.engine.scheduler\n"
            "assert not [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_one_tenant_is_first_come_first_served() -> None:
    fs = FairShare(64)
    queue = [seq("", prompt_len=n) for n in (50, 3, 900, 4)]
    assert fs.pick(queue) is queue[0]
    fs.charge(queue[0])
    assert fs.deficit == {"": 0.0}  # nothing is billed when no one else waits


def test_shares_three_to_one_admit_three_to_one() -> None:
    """Two tenants flooding at once, shares 3:1: over the run, admissions (equal-sized requests) are 3:1
    within 10%, and so are the output tokens their seats generate."""
    sched = Scheduler(BlockManager(4096, 4), max_num_seqs=8, max_num_batched_tokens=64)
    tokens: Counter = Counter()
    order = admissions(sched, 600, {"big": (3.0, 40), "small": (1.0, 40)}, tokens)
    n = Counter(order)
    assert n["small"] >= 50, n
    assert abs(n["big"] / n["small"] - 3.0) <= 0.3, n
    assert abs(tokens["big"] / tokens["small"] - 3.0) <= 0.3, tokens
    for start in range(0, len(order) - 40, 40):  # and in every window of 40 admissions, not only on average
        w = Counter(order[start:start + 40])
        assert 8 <= w["small"] <= 12, (start, w)


def test_the_smallest_share_is_not_starved_by_a_flood() -> None:
    """A tenant with a tenth of the other's share and a few requests behind a 500-request flood: each of its
    requests is admitted within a round of the flood's, not after it. (First come, first served, the order
    before fair share, would admit all 500 first: the check below then fails.)"""
    sched = Scheduler(BlockManager(8192, 4), max_num_seqs=4, max_num_batched_tokens=64)
    for _ in range(500):
        sched.add(seq("flood", share=10.0))
    late = [seq("tiny", share=1.0) for _ in range(5)]
    for s in late:
        sched.add(s)
    order = admissions(sched, 400)
    positions = [i for i, t in enumerate(order) if t == "tiny"]
    assert len(positions) == 5, Counter(order)
    # A round credits tiny one quantum (64 tokens: 4 of its 16-token requests) and the flood ten (40 of them):
    # tiny's k-th request is admitted within round k // 4 + 1, i.e. after at most 44 admissions a round.
    assert all(p < (k // 4 + 1) * 44 for k, p in enumerate(positions)), positions


def test_cost_is_what_a_sequence_may_compute_so_big_requests_count_more() -> None:
    """Tokens, not requests: a tenant sending requests 4x the size is admitted 4x less often at equal share."""
    assert cost(seq("a", prompt_len=10, max_tokens=6)) == 16
    fs = FairShare(32)
    queue = [seq("big", prompt_len=56, max_tokens=8) for _ in range(50)] + [seq("small") for _ in range(50)]
    picked = []
    for _ in range(50):
        s = fs.pick(queue)
        assert s is not None
        fs.charge(s)
        queue.remove(s)
        picked.append(s.request.tenant)
    n = Counter(picked)
    assert abs(n["small"] / n["big"] - 4.0) <= 0.5, n


def test_interactive_goes_ahead_of_batch_and_batch_runs_when_none_waits() -> None:
    fs = FairShare(64)
    queue = [seq("eval", batch=True) for _ in range(3)] + [seq("chat"), seq("chat")]
    order = []
    while queue:
        s = fs.pick(queue)
        assert s is not None
        fs.charge(s)
        queue.remove(s)
        order.append(s.request.tenant)
    assert order == ["chat", "chat", "eval", "eval", "eval"]


def test_a_recomputed_sequence_goes_first_and_is_not_billed_twice() -> None:
    fs = FairShare(16)
    a, b = seq("a"), seq("b")
    resumed = seq("b")
    resumed.num_preemptions = 1
    assert fs.pick([resumed, a, b]) is resumed
    fs.charge(resumed)
    assert fs.deficit.get("b", 0.0) == 0.0


def test_an_idle_tenant_forfeits_its_credit() -> None:
    """DRR: credit left when a tenant's queue empties is dropped, so it cannot come back with a burst."""
    fs = FairShare(1000)
    a, b = seq("a"), seq("b")
    s = fs.pick([a, b])
    fs.charge(s)
    assert fs.deficit[s.request.tenant] == 1000 - cost(s)
    other = b if s is a else a
    assert fs.pick([other]) is other and s.request.tenant not in fs.deficit


def test_out_of_kv_space_a_batch_sequence_is_preempted_before_a_newer_interactive_one() -> None:
    """The cache fills up with an interactive, a batch and a newer interactive sequence; when they need a block
    each to go on, the batch one is preempted. (Without priorities it would be the newest, the interactive c.)"""
    sched = Scheduler(BlockManager(6, 4, prefix_caching=False), max_num_seqs=3, max_num_batched_tokens=64)
    a, b = seq("chat", prompt_len=7, max_tokens=8), seq("evals", prompt_len=7, max_tokens=8, batch=True)
    sched.add(a)
    sched.add(b)
    step(sched)
    c = seq("chat", prompt_len=8, max_tokens=8)
    sched.add(c)
    step(sched)  # a and b decode into their second block; c's prompt takes two: the cache is full
    assert sched.block_manager.num_free_blocks == 0 and sched.running == [a, b, c]
    out, _ = step(sched)  # each now needs a third block
    assert out.preempted == [b] and b in sched.waiting
    assert {i.seq.request_id for i in out.scheduled} == {a.request_id, c.request_id}
