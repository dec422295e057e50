"""Fair share between tenants in the scheduler (engine/fair_share.py): deficit round-robin by weight over the
tokens a sequence may compute, strict priority between classes, FIFO for one tenant; pure Python (no torch)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

from steadyserve.engine.block_manager import BlockManager
from steadyserve.engine.fair_share import FairShare, cost, split_step
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
    seen: set[int] = set()
    for _ in range(steps):
        for tenant, (share, backlog) in (refill or {}).items():
            while sum(1 for s in sched.waiting if s.request.tenant == tenant) < backlog:
                sched.add(seq(tenant, share=share))
        out, _ = step(sched)
        # first scheduling only (an admission whose prompt a light tenant's step put off counts when it runs): a
        # sequence seated again after a preemption was counted when first scheduled
        new = [i.seq for i in out.scheduled if i.seq.seq_id not in seen and not i.seq.num_preemptions]
        seen.update(s.seq_id for s in new)
        order += [s.request.tenant for s in new]
        if tokens is not None:
            tokens.update(i.seq.request.tenant for i in out.scheduled
                          if i.seq.num_computed_tokens >= i.seq.num_prompt_tokens)
    return order


def test_fair_share_seating_and_scheduler_import_no_torch() -> None:
    code = ("import sys\nimport steadyserve.engine.fair_share, steadyserve.engine.seating, steadyserve.engine.scheduler\n"
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
    # A round credits tiny one quantum (32 tokens: 2 of its 16-token requests) and the flood ten (20 of them):
    # tiny's k-th request is admitted within round k // 2 + 1, i.e. after at most 22 admissions a round. Its prompt
    # may then wait one step more: the flood, holding fewer than its 3.6 of the 4 seats, is the one below its share,
    # and a step with its prompts holds no other tenant's (seating.Sharing): up to 3 of them come first.
    assert all(p < (k // 2 + 1) * 22 + 3 for k, p in enumerate(positions)), positions


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


# ---- the step's token budget (fair_share.split_step, Scheduler._prefill_caps / _top_up) -----------------------

def long_seq(tenant: str, prompt_len: int, share: float = 1.0, max_tokens: int = 1, batch: bool = False) -> Sequence:
    """A sequence whose prompt shares no prefix with any other's (no prefix-cache hits)."""
    i = next(_ids)
    prompt = [(i * 7919 + k) % 50000 for k in range(prompt_len)]
    return Sequence(i, Request(f"{tenant}-{i}", prompt, SamplingParams(max_tokens=max_tokens), tenant=tenant,
                               share=share, batch=batch))


def prompt_tokens(sched: Scheduler, steps: int, refill: dict[str, tuple[float, int, int]] | None = None
                  ) -> tuple[Counter, list[int]]:
    """Prompt tokens computed per tenant over `steps` steps, and each step's total. `refill`: tenant -> (share,
    prompt length, backlog): keeps that many of its long-prompt sequences waiting."""
    got: Counter = Counter()
    totals = []
    for _ in range(steps):
        for tenant, (share, length, backlog) in (refill or {}).items():
            while sum(1 for s in sched.waiting if s.request.tenant == tenant) < backlog:
                sched.add(long_seq(tenant, length, share))
        before = {id(i): i.num_computed_tokens for i in [*sched.running, *sched.waiting]}
        out, _ = step(sched)
        for item in out.scheduled:
            s = item.seq
            prompt_part = min(s.num_computed_tokens, s.num_prompt_tokens) - min(before.get(id(s), 0),
                                                                                  s.num_prompt_tokens)
            got[s.request.tenant] += prompt_part
        totals.append(out.num_tokens)
    return got, totals


def test_split_step_is_water_filling_by_weight_interactive_first() -> None:
    assert split_step({"a": 1000, "b": 1000}, {"a": 3.0, "b": 1.0}, {"a": False, "b": False}, 100) == \
        {"a": 75, "b": 25}
    # b needs only 10: a gets the rest, nothing is left idle
    assert split_step({"a": 1000, "b": 10}, {"a": 1.0, "b": 1.0}, {"a": False, "b": False}, 100) == \
        {"a": 90, "b": 10}
    # strict priority: batch gets what interactive leaves
    assert split_step({"e": 1000, "c": 30}, {"e": 5.0, "c": 1.0}, {"e": True, "c": False}, 100) == \
        {"e": 70, "c": 30}
    # a share too small to round to a token still gets one
    caps = split_step({"big": 1000, "tiny": 1000}, {"big": 1000.0, "tiny": 1.0}, {"big": False, "tiny": False}, 64)
    assert caps["tiny"] >= 1 and sum(caps.values()) == 64


def test_a_steps_prompt_tokens_are_shared_by_weight_not_by_admission_order() -> None:
    """A admitted four long prompts first; B's one long prompt, admitted after, gets half of every step (equal
    shares) instead of waiting for A's four to finish. (Admission order, the rule before, gives B nothing for
    the first 60 steps: the assertion on B then fails.) Every step still computes the whole budget."""
    sched = Scheduler(BlockManager(4096, 16), max_num_seqs=8, max_num_batched_tokens=64)
    for _ in range(4):
        sched.add(long_seq("A", 1000))
    step(sched)  # A's four are running
    sched.add(long_seq("B", 1000))
    got, totals = prompt_tokens(sched, 20)
    assert abs(got["B"] - got["A"]) <= 0.1 * got["A"], got
    assert all(t == 64 for t in totals), totals


def test_shares_three_to_one_split_each_step_three_to_one() -> None:
    sched = Scheduler(BlockManager(8192, 16), max_num_seqs=8, max_num_batched_tokens=64)
    got, totals = prompt_tokens(sched, 60, refill={"three": (3.0, 500, 4), "one": (1.0, 500, 4)})
    assert abs(got["three"] / got["one"] - 3.0) <= 0.3, got
    assert all(t == 64 for t in totals[1:]), totals


def test_the_smallest_share_still_progresses_every_step_under_a_flood() -> None:
    """A tenant of share 1 against a flood of share 10 holding the other seats with long prompts and 20 more
    waiting: once admitted, its prompt advances every step by its share of the budget (64 / 11, rounded down: 5
    tokens), and it is done long before any of the flood's. (By admission order it would advance by nothing
    until the flood's 2000-token prompts were done.)"""
    sched = Scheduler(BlockManager(16384, 16), max_num_seqs=8, max_num_batched_tokens=64)
    for _ in range(7):
        sched.add(long_seq("flood", 2000, 10.0))
    step(sched)
    tiny = long_seq("tiny", 40, 1.0)
    sched.add(tiny)
    progress = []
    for _ in range(30):
        before = tiny.num_computed_tokens
        _, totals = prompt_tokens(sched, 1, refill={"flood": (10.0, 2000, 20)})
        assert totals == [64]
        if before or tiny.num_computed_tokens:  # admitted
            progress.append(tiny.num_computed_tokens - before)
        if tiny.num_computed_tokens >= tiny.num_prompt_tokens:
            break
    assert tiny.num_computed_tokens >= tiny.num_prompt_tokens and len(progress) <= 9, progress
    assert all(p >= 5 for p in progress[1:-1]), progress
    assert all(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running if s.request.tenant == "flood")


def test_one_tenant_schedules_exactly_as_before() -> None:
    """No split with one tenant: the oldest running prompt takes the budget first (admission order)."""
    sched = Scheduler(BlockManager(4096, 16), max_num_seqs=8, max_num_batched_tokens=64)
    first, second = long_seq("only", 300), long_seq("only", 300)
    sched.add(first)
    sched.add(second)
    out, _ = step(sched)
    assert [(i.seq, i.num_new_tokens) for i in out.scheduled] == [(first, 64)]


def test_a_tenant_with_nothing_running_is_seated_at_once_when_a_flood_holds_every_seat() -> None:
    """Decode rows by weight: equal shares, A holds all 4 seats with long requests; B's request is seated in the
    next step (A's newest is preempted, first in line, and recomputed later) instead of waiting for A's to end.
    (Without the seat rule B waits the 100+ steps of A's requests: the first assertion fails.)"""
    sched = Scheduler(BlockManager(8192, 4), max_num_seqs=4, max_num_batched_tokens=64)
    a = [long_seq("A", 8, max_tokens=120) for _ in range(4)]
    for s in a:
        sched.add(s)
    step(sched)
    b = long_seq("B", 8, max_tokens=4)
    sched.add(b)
    out, _ = step(sched)
    assert b in sched.running and out.preempted == [a[-1]], (out.preempted, sched.running)
    assert sched.waiting[0] is a[-1]  # first in line for the next free seat
    for _ in range(20):
        step(sched)
    assert a[-1] in sched.running and sched.num_preemptions == 1  # back once B's seat freed; no more preemption


def test_one_tenant_or_a_tenant_already_seated_waits_for_a_free_seat() -> None:
    sched = Scheduler(BlockManager(8192, 4), max_num_seqs=2, max_num_batched_tokens=64)
    for s in (long_seq("A", 8, max_tokens=50), long_seq("A", 8, max_tokens=50)):
        sched.add(s)
    step(sched)
    sched.add(long_seq("A", 8))
    step(sched)
    assert sched.num_preemptions == 0  # one tenant: as before
    sched = Scheduler(BlockManager(8192, 4), max_num_seqs=3, max_num_batched_tokens=64)
    for s in (long_seq("A", 8, max_tokens=50), long_seq("A", 8, max_tokens=50), long_seq("B", 8, max_tokens=50)):
        sched.add(s)
    step(sched)
    sched.add(long_seq("B", 8))
    step(sched)
    assert sched.num_preemptions == 0  # B holds a seat already: its second request waits


def test_an_interactive_tenant_takes_a_batch_tenants_seat() -> None:
    sched = Scheduler(BlockManager(8192, 4), max_num_seqs=2, max_num_batched_tokens=64)
    evals = [long_seq("evals", 8, share=10.0, max_tokens=50, batch=True) for _ in range(2)]
    for s in evals:
        sched.add(s)
    step(sched)
    chat = long_seq("chat", 8, max_tokens=4)
    sched.add(chat)
    out, _ = step(sched)
    assert chat in sched.running and out.preempted == [evals[-1]]
