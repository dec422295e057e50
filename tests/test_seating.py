"""Seating a tenant below its weighted share of seats at once, every seat taken (engine/seating.py), inside the
Scheduler; pure Python (no torch). The rules for a tenant with nothing running, batch against interactive and one
tenant are in test_fair_share.py."""

from __future__ import annotations

from test_fair_share import step  # one step as the engine runs it

from steadyserve.engine.block_manager import BlockManager
from steadyserve.engine.scheduler import Scheduler
from steadyserve.engine.seating import SHARING_WINDOW_S, Sharing
from steadyserve.engine.sequence import Request, SamplingParams, Sequence

_ids = iter(range(10**9))


def req(tenant: str, max_tokens: int, share: float = 1.0, prompt_len: int = 12) -> Sequence:
    """A sequence whose prompt shares no prefix with any other's (no prefix-cache hits)."""
    i = next(_ids)
    prompt = [(i * 7919 + k) % 50000 for k in range(prompt_len)]
    return Sequence(i, Request(f"{tenant}-{i}", prompt, SamplingParams(max_tokens=max_tokens), tenant=tenant,
                               share=share))


def test_a_light_tenant_whose_last_request_still_runs_is_seated_at_once_under_a_flood() -> None:
    """benchmarks/tenants.py in steps: equal shares, 8 seats, A keeps 40 requests of 32 tokens waiting; B sends
    one every 20 steps, each running ~33 steps, so its next arrives while its last still runs. B holds 1-2 seats of
    its 4: each of its requests is scheduled in the step after it arrives, and no sequence is preempted twice.
    (With only a tenant with nothing running seated at once, B's second request waits for a seat that A's turns
    keep taking: the first assertion fails.)"""
    sched = Scheduler(BlockManager(8192, 16), max_num_seqs=8, max_num_batched_tokens=512)
    b_seqs: list[tuple[int, Sequence]] = []
    waits: dict[int, int] = {}  # B's request -> steps from its arrival to the step that first scheduled it
    for t in range(400):
        while sum(1 for s in sched.waiting if s.request.tenant == "A") < 40:
            sched.add(req("A", 32))
        if t % 20 == 10:
            b_seqs.append((t, req("B", 32)))
            sched.add(b_seqs[-1][1])
        step(sched)
        for arrived, b in b_seqs:
            if b.first_scheduled_time is not None:
                waits.setdefault(id(b), t - arrived)
    assert len(b_seqs) == 20 and list(waits.values()) == [0] * 20, list(waits.values())
    everyone = [*sched.running, *sched.waiting, *(b for _, b in b_seqs)]
    assert max(s.num_preemptions for s in everyone) <= 1
    assert all(b.num_preemptions == 0 for _, b in b_seqs)  # the light tenant is never the one to give a seat up


def test_a_heavier_tenant_below_its_seats_does_not_preempt_a_lighter_ones() -> None:
    """Weights 10 and 1, 4 seats: the light tenant holds 2 (admission's turns go by tokens, and its requests are
    short), the heavy one 2 of its 3.6 with more waiting. The heavy one's seats come back through its turns as
    seats free; the light one's running requests are not preempted to make up its count. (Without the weight rule
    one of the light tenant's sequences is preempted: the assertion fails.)"""
    sched = Scheduler(BlockManager(8192, 16), max_num_seqs=4, max_num_batched_tokens=64)
    light = [req("light", 50, share=1.0) for _ in range(2)]
    heavy = [req("heavy", 50, share=10.0) for _ in range(2)]
    for s in [*light, *heavy]:
        sched.add(s)
    step(sched)
    step(sched)  # the light tenant's second prompt: one a step while tenants share at weights 1 and 10
    assert len(sched.running) == 4
    for _ in range(10):
        sched.add(req("heavy", 50, share=10.0))
    for _ in range(5):
        step(sched)
    assert sched.num_preemptions == 0 and all(s in sched.running for s in light)


def test_no_seat_ping_pong_between_two_flooding_tenants_of_unequal_weights() -> None:
    """Weights 3 and 1, both flooding with 40 waiting, 8 seats: over 600 steps the seats settle near 6:2 without
    preempting anyone more than once, and with fewer seat preemptions than the light tenant's admissions."""
    sched = Scheduler(BlockManager(16384, 16), max_num_seqs=8, max_num_batched_tokens=512)
    seen: list[Sequence] = []
    for _ in range(600):
        for tenant, share in (("C", 3.0), ("D", 1.0)):
            while sum(1 for s in sched.waiting if s.request.tenant == tenant) < 40:
                seen.append(req(tenant, 32, share=share))
                sched.add(seen[-1])
        step(sched)
    assert max(s.num_preemptions for s in seen) <= 1
    admitted_d = sum(1 for s in seen if s.request.tenant == "D" and s.first_scheduled_time is not None)
    assert sched.num_preemptions <= admitted_d, (sched.num_preemptions, admitted_d)


def test_no_sequence_gives_up_its_seat_twice() -> None:
    """A holds the 4 seats with long requests; B's short requests come one after another, each seated at once in
    place of A's newest. A's sequence preempted for B's first is back (first in line) when B's second comes; it is
    not preempted again: another of A's gives the seat up. (Taking A's newest each time preempts the same
    sequence over and over, losing its progress every time: the assertion fails.)"""
    sched = Scheduler(BlockManager(8192, 16), max_num_seqs=4, max_num_batched_tokens=64)
    a = [req("A", 200) for _ in range(4)]
    for s in a:
        sched.add(s)
    step(sched)
    for _ in range(3):
        b = req("B", 2)
        sched.add(b)
        while b.status.name != "FINISHED":
            step(sched)
        step(sched)  # A's preempted sequence takes the freed seat back
        assert len(sched.running) == 4
    assert sched.num_preemptions == 3 and max(s.num_preemptions for s in a) == 1, [s.num_preemptions for s in a]


def test_a_seated_prompt_runs_in_a_step_of_its_own() -> None:
    """Every seat taken by A's flood, B arrives: the step that seats B computes B's prompt alone, so B's first token
    waits for a one-row step rather than a full batch's; the step after, A's rows and B's decode row run together
    again. (With the seated prompt joining the batch's step, B's step holds 8 sequences: the first assertion
    fails.)"""
    sched = Scheduler(BlockManager(8192, 16), max_num_seqs=8, max_num_batched_tokens=512)
    for _ in range(30):
        while sum(1 for s in sched.waiting if s.request.tenant == "A") < 40:
            sched.add(req("A", 32))
        step(sched)
    assert len(sched.running) == 8
    b = req("B", 32)
    sched.add(b)
    out, _ = step(sched)
    assert [i.seq for i in out.scheduled] == [b] and out.scheduled[0].num_new_tokens == b.num_prompt_tokens
    assert len(out.preempted) == 1 and out.preempted[0].request.tenant == "A"
    out, _ = step(sched)
    assert b in [i.seq for i in out.scheduled] and len(out.scheduled) == 8


def _prompts(out, tenant: str) -> int:
    """Prompt chunks of `tenant` in a step's plan (a prompt computes more than one token; decode rows one)."""
    return sum(1 for i in out.scheduled if i.seq.request.tenant == tenant and i.num_new_tokens > 1)


def _flood_in_lockstep(sched: Scheduler, steps: int, clock: list[float] | None = None) -> int:
    """A keeps 40 requests of 8 tokens waiting for the 8 seats, so its streams end together and their seats free
    together; returns the most prompts of A that one step computed."""
    most = 0
    for _ in range(steps):
        while sum(1 for s in sched.waiting if s.request.tenant == "A") < 40:
            sched.add(req("A", 8))
        out, _ = step(sched)
        most = max(most, _prompts(out, "A"))
        if clock is not None:
            clock[0] += 0.02
    return most


def test_while_tenants_share_a_flood_computes_one_prompt_a_step() -> None:
    """A's 8 streams end in the same step; alone on the server its next 8 prompts run in one step (as before tenants
    existed). Once B has sent a request, within the sharing window, A's prompts come one a step, so a step in
    progress when B's next request arrives is a batch's decode rows and one prompt, not 8 prompts. (Without the
    rule every refill is again one step of 8 prompts: the second assertion fails.)"""
    sched = Scheduler(BlockManager(8192, 16), max_num_seqs=8, max_num_batched_tokens=512)
    assert _flood_in_lockstep(sched, 40) == 8
    b = req("B", 2)
    sched.add(b)
    assert _flood_in_lockstep(sched, 120) == 1
    assert b.status.name == "FINISHED"


def test_sharing_ends_a_window_after_the_last_request_of_the_other_tenant() -> None:
    """A test clock: 20 ms a step; B's one request; after SHARING_WINDOW_S without another, A alone fills freed
    seats in one step again."""
    clock = [0.0]
    sched = Scheduler(BlockManager(8192, 16), max_num_seqs=8, max_num_batched_tokens=512)
    sched.sharing = Sharing(clock=lambda: clock[0])
    sched.add(req("B", 2))
    assert _flood_in_lockstep(sched, 100, clock) == 1  # 2 s: sharing
    clock[0] += SHARING_WINDOW_S
    for s in list(sched.running):  # the 8 seats free at once (sharing spread A's streams over steps)
        sched.abort(s.request_id)
    assert _flood_in_lockstep(sched, 40, clock) == 8


def test_a_light_tenants_prompt_shares_its_step_with_no_other_tenants_prompt() -> None:
    """Seats free as A's streams end, A's prompts waiting, B's request arrives: the step that computes B's prompt
    has A's decode rows in it but none of A's prompts (they go in the steps after) while A holds its share of the
    seats, so B's first token waits for a step of decode rows and its own prompt. (Without the rule, A's one prompt
    of that step, admitted on its turn, runs beside B's: the assertion fails.)"""
    sched = Scheduler(BlockManager(8192, 16), max_num_seqs=8, max_num_batched_tokens=512)
    sched.add(req("B", 2))
    for _ in range(9):  # B's first request done; A's streams in lockstep, the last step ended all 8
        while sum(1 for s in sched.waiting if s.request.tenant == "A") < 40:
            sched.add(req("A", 8))
        step(sched)
    b_steps = []
    for _ in range(200):
        while sum(1 for s in sched.waiting if s.request.tenant == "A") < 40:
            sched.add(req("A", 8))
        if len(sched.running) < 8 and not any(s.request.tenant == "B" for s in [*sched.running, *sched.waiting]):
            sched.add(req("B", 2))  # arrives as a seat frees
        a_seats = sum(1 for s in sched.running if s.request.tenant == "A")
        out, _ = step(sched)
        if _prompts(out, "B") and a_seats >= 4:  # A at its share of the seats (below it, it is light too)
            b_steps.append(out)
    assert len(b_steps) >= 10
    assert all(_prompts(out, "A") == 0 for out in b_steps), [_prompts(out, "A") for out in b_steps]
    assert any(len(out.scheduled) > 1 for out in b_steps)  # A's decode rows ran with B's prompt
