"""Who gets a seat at once when every seat (--max-num-seqs) is taken, and whose sequence gives it up.

Pure Python, no torch (tests/test_seating.py and tests/test_fair_share.py drive it inside the Scheduler).

Admission's deficit round-robin (fair_share.py) shares the seats over time, as they free. That is too slow for a
light tenant under a flood: its request would wait for a flood's stream to end (tens of steps) although its
weight entitles it to more seats than it holds. So, with every seat taken, a waiting sequence is seated now in
place of another tenant's newest sequence (preempted, first in line for the next free seat, recomputed later from
the prefix cache: the numerics keep its bits), its prompt in a step of its own (Scheduler: its first token then waits
for a one-row step, not a full batch's), when:

* its tenant holds fewer seats than the floor of its weighted share of --max-num-seqs (its weight over those of
  the tenants with work, running or waiting), or none at all;
* and the seat comes from a `batch` tenant's newest sequence if `seq` is `interactive` and one runs, otherwise
  from the tenant of its own class furthest above its share that keeps at least its share and a seat after
  giving one up.

A tenant that holds a seat already takes one only from a tenant of at least its weight: a heavier tenant's
seats come back through admission's turns within a round (it has that many more of them), and a light tenant's
short requests, which the turns admit by tokens, are not preempted to make up a heavy one's count of seats.

No ping-pong: the seater ends at or below its share and the loser at or above its own, so neither qualifies to
take the seat back. Hysteresis against churn when the tenants with work come and go (extreme weights, a tenant
that just arrived): a sequence ever preempted is never seated this way (it is first in line anyway) nor chosen
to give up a seat again. On a server with one tenant nobody is seated this way: it schedules exactly as before
tenants existed.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence as Seq

from .sequence import Sequence

# How long a tenant counts as sharing the server after its last request arrived. A light tenant's next request
# comes while it has nothing running (one a second, each done in half a second): the steps must already be short
# when it arrives, since a step in progress is never interrupted.
SHARING_WINDOW_S = 10.0


class Sharing:
    """Whether two or more tenants sent requests within the last SHARING_WINDOW_S seconds. While they do, a step
    carries a few prompts at most of each tenant (prompt_limits; Scheduler), so a burst of a flood's admissions (its
    streams end together, their seats free together) spreads over steps instead of making one step of all of them,
    which a light tenant's request arriving meanwhile would wait out: that long step, a flood's six prompts beside
    the batch, was the tail of the light tenant's time to first token. With one tenant (every server without a keys
    file) it is never active: steps are as before tenants existed."""

    def __init__(self, window_s: float = SHARING_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s  # seconds a tenant's last arrival keeps it counted
        self.clock = clock  # monotonic seconds (a test's own clock)
        self._last: dict[str, tuple[float, float]] = {}  # tenant -> when its last request arrived, its weight

    def saw(self, tenant: str, share: float) -> None:
        self._last[tenant] = (self.clock(), share)

    def active(self) -> bool:
        if len(self._last) < 2:
            return False
        now = self.clock()
        self._last = {t: seen for t, seen in self._last.items() if now - seen[0] <= self.window_s}
        return len(self._last) >= 2

    def step(self, running: Seq[Sequence], waiting: Iterable[Sequence], max_num_seqs: int) -> StepPrompts | None:
        """The prompt rules of the step being planned while tenants share the server; None when they do not."""
        if not self.active():
            return None
        weights = {t: share for t, (_, share) in self._last.items()}
        return StepPrompts(light_tenants(running, waiting, max_num_seqs), prompt_limits(weights, max_num_seqs))


@dataclass
class StepPrompts:
    """Which prompts one step may compute while tenants share the server (Scheduler._schedule asks it)."""

    light: set[str]  # tenants below their share of the seats at the step's start (light_tenants)
    limit: dict[str, int]  # prompts a tenant may compute in the step (prompt_limits; 1 for one not listed)
    started: Counter[str] = field(default_factory=Counter)  # prompts planned so far, by tenant
    light_step: bool = False  # a light tenant's prompt is planned: no other tenant's prompt joins the step

    def start(self, tenant: str) -> bool:
        """Whether a prompt of `tenant` may join the step; counted if so."""
        if self.started[tenant] >= self.limit.get(tenant, 1) or self.light_step and tenant not in self.light:
            return False
        self.started[tenant] += 1
        return True

    def start_light(self, tenant: str) -> bool:
        """`start` for a light tenant only (one whose waiting prompt may come in ahead of the turn)."""
        return tenant in self.light and self.start(tenant)

    def opens_light_step(self, tenant: str) -> bool:
        """Whether `tenant`'s prompt, just started, is the step's first light one: the other tenants' prompts then
        leave the step (the caller takes them out of its plan)."""
        if tenant in self.light and not self.light_step:
            self.light_step = True
            return True
        return False


def seat_counts(running: Seq[Sequence], waiting: Iterable[Sequence],
                max_num_seqs: int) -> tuple[dict[str, int], dict[str, float]] | None:
    """Seats each tenant holds and its weighted share of --max-num-seqs (over the tenants with work, running or
    waiting); None when fewer than two tenants have work."""
    shares = {s.request.tenant: s.request.share for s in [*running, *waiting]}
    if len(shares) < 2:
        return None
    counts: dict[str, int] = {}
    for s in running:
        counts[s.request.tenant] = counts.get(s.request.tenant, 0) + 1
    total = sum(shares.values())
    return counts, {t: max_num_seqs * w / total for t, w in shares.items()}


def light_tenants(running: Seq[Sequence], waiting: Iterable[Sequence], max_num_seqs: int) -> set[str]:
    """The tenants below their weighted share of the seats: holding none, or fewer than its floor (the rule that
    seats a waiting sequence at once). Empty when fewer than two tenants have work."""
    got = seat_counts(running, waiting, max_num_seqs)
    if got is None:
        return set()
    counts, fair = got
    return {t for t in fair if not _holds_its_share(counts.get(t, 0), fair[t])}


def prompt_limits(shares: dict[str, float], max_num_seqs: int) -> dict[str, int]:
    """Prompts each tenant sharing the server (`shares`: tenant -> weight) may compute in one step: a quarter of
    the seats' worth in all (at least one per unit of the smallest weight), split by weight (each tenant's weight
    over the smallest, rounded, at least one). So a flood whose seats all free in one step refills them over four
    steps or more, not in one step of all its prompts, and shares 3:1 start prompts 3:1, so the shares hold.
    Eight seats between two equal tenants: one prompt each a step; sixty-four: eight."""
    if not shares:
        return {}
    smallest = min(shares.values())
    units = {t: max(1, round(w / smallest)) for t, w in shares.items()}
    per_unit = max(1, max_num_seqs // (4 * sum(units.values())))
    return {t: u * per_unit for t, u in units.items()}


def _holds_its_share(held: int, fair: float) -> bool:
    return bool(held) and held >= math.floor(fair)


def seat_for_waiting(waiting: Iterable[Sequence], running: Seq[Sequence],
                     max_num_seqs: int) -> tuple[Sequence, Sequence] | None:
    """With every seat taken: the first waiting sequence, per tenant in queue order, that `seat_victim` finds a
    seat for, and that victim; else None. Outside the DRR turn: a tenant below its share is the one whose turn
    would keep it waiting for seats a flood holds."""
    waiting = list(waiting)
    got = seat_counts(running, waiting, max_num_seqs)
    if got is None:
        return None
    counts, fair = got
    tried: set[str] = set()
    for seq in waiting:
        t = seq.request.tenant
        if t in tried:
            continue
        tried.add(t)
        victim = seat_victim(seq, running, counts, fair)
        if victim is not None:
            return seq, victim
    return None


def seat_victim(seq: Sequence, running: Seq[Sequence], counts: dict[str, int],
                fair: dict[str, float]) -> Sequence | None:
    """Whose sequence gives `seq` its seat (see the module's rules), or None: `seq` waits for a free seat."""
    mine = seq.request.tenant
    held = counts.get(mine, 0)
    if seq.num_preemptions:
        return None
    if _holds_its_share(held, fair[mine]):
        return None
    batch = {s.request.tenant: s.request.batch for s in running}
    candidates: list[str] = []
    if not seq.request.batch:  # interactive first: a batch tenant's seat is taken whatever its share
        candidates = [t for t in counts if batch[t]]
    if not candidates:
        share = {s.request.tenant: s.request.share for s in running}
        candidates = [t for t in counts if t != mine and batch[t] == seq.request.batch
                      and counts[t] >= 2 and counts[t] - 1 >= fair[t]
                      and (held == 0 or share[t] >= seq.request.share)]
    for loser in sorted(candidates, key=lambda t: counts[t] - fair[t], reverse=True):
        victim = next((s for s in reversed(running) if s.request.tenant == loser and not s.num_preemptions), None)
        if victim is not None:
            return victim
    return None
