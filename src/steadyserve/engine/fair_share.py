"""Which waiting sequence the scheduler admits next when several tenants wait: deficit round-robin by weight.

Pure Python, no torch (tests/test_fair_share.py runs it alone and inside the Scheduler).

Each tenant (Request.tenant; "" on a server without a keys file) is a queue: its waiting sequences in the
scheduler's order. The tenants with sequences waiting take turns (Shreedhar and Varghese's deficit round-robin,
with variable-sized packets): a tenant's turn begins with a credit of `quantum * weight / smallest weight`
tokens added to its deficit (so the smallest share still gets a whole quantum a round), and it admits its
sequences in order while its deficit covers the next one's cost; then the turn passes on. The cost of a
sequence is the tokens it may compute: its prompt plus its max_tokens (prompt tokens found in the prefix cache
included: what it holds in the cache). A tenant whose queue empties forfeits its deficit, as in DRR, so saved-up
credit cannot be spent in a burst later.

Over any stretch where tenants keep sequences waiting, the tokens admitted for each differ from its weight's
share of the total by at most one sequence's cost plus one quantum (times its weight ratio); so shares 3:1 admit
3:1, and the smallest share gains a whole quantum every round, so its next sequence is admitted within
cost / quantum rounds however many others wait: no tenant starves behind a flood.

Two rules come first. A preempted sequence waiting to be recomputed was already charged and is re-admitted
ahead of everything (it holds the head of the queue), as before tenants existed. Priority is strict between
classes: while any `interactive` sequence waits, only interactive tenants take turns (Request.batch); batch
tenants keep their place and credit meanwhile. With one tenant (every server without a keys file) the pick is
the queue's head: first come, first served.

Inside a step (split_step), the tokens left after the decode rows (one per decoding sequence: seats, which the
admission above shares) are divided among the tenants with prompt tokens to compute, running or waiting, by the
same weights and the same strict priority, water-filling: a tenant that needs less than its share leaves the rest
to the others, and each one with work gets at least a token while any are left. So a tenant whose long prompts
were admitted first cannot take every step's budget until they are done; what no tenant can use goes back to
the running prompts in order (the scheduler's top-up), so sharing never leaves budget idle.
"""

from __future__ import annotations

from typing import Iterable

from .sequence import Sequence

# Tokens a turn credits to the smallest waiting weight. Small against a request's cost (prompt + max_tokens), so a
# turn admits about one request of the smallest share and the turns interleave request by request: with a quantum
# of a whole step's budget (512 tokens), a flooding tenant's turn admitted ~10 short requests, one per seat as seats
# freed, while a light tenant's request waited for the turn to end (0.9 s of TTFT in benchmarks/tenants.py). The
# shares are the same at any quantum (DRR's bound: one request's cost plus one quantum); a pick whose head costs
# more than a quantum takes more rounds of its loop, a few microseconds.
QUANTUM_TOKENS = 32


def cost(seq: Sequence) -> int:
    """Tokens a sequence may compute in all: what its admission is charged."""
    return max(1, seq.num_prompt_tokens + seq.params.max_tokens)


class FairShare:
    def __init__(self, quantum: int = QUANTUM_TOKENS) -> None:
        self.quantum = quantum  # tokens a turn credits to the smallest waiting weight (QUANTUM_TOKENS)
        self.deficit: dict[str, float] = {}  # tenant -> credit left to spend in its turn
        self.ring: list[str] = []  # tenants with sequences waiting, in round-robin order (arrival of their first)
        self.current: str | None = None  # whose turn it is
        self._contested: str | None = None  # the tenant the last pick chose among several: `charge` bills it

    def pick(self, waiting: Iterable[Sequence]) -> Sequence | None:
        """The sequence to admit next, without taking it (the scheduler may find no room for it, and asks
        again next step); `charge` it once admitted."""
        self._contested = None
        heads: dict[str, Sequence] = {}
        first: Sequence | None = None
        for seq in waiting:
            if first is None:
                if seq.num_preemptions:  # recomputed: charged at its first admission, and first in line
                    return seq
                first = seq
            heads.setdefault(seq.request.tenant, seq)
        if first is None:
            return None
        successor = self._keep(heads)
        eligible = heads
        if any(not s.request.batch for s in heads.values()):  # strict priority: interactive first
            eligible = {t: s for t, s in heads.items() if not s.request.batch}
        if len(eligible) == 1:
            return next(iter(eligible.values()))
        smallest = min(s.request.share for s in eligible.values())
        tenant = self.current if successor is None and self.current in eligible else None
        if tenant is None:
            start = successor if successor is not None else self.ring[0]
            tenant = self._begin_turn(start if start in eligible else self._after(start, eligible), eligible,
                                      smallest)
        while self.deficit[tenant] < cost(eligible[tenant]):
            tenant = self._begin_turn(self._after(tenant, eligible), eligible, smallest)
        self._contested = tenant
        return eligible[tenant]

    def charge(self, seq: Sequence) -> None:
        """`seq` was admitted: when the last pick chose it among tenants, its tenant's deficit pays its cost."""
        tenant = seq.request.tenant
        if tenant == self._contested and not seq.num_preemptions:
            self.deficit[tenant] -= cost(seq)
        self._contested = None

    def _after(self, tenant: str, eligible: dict[str, Sequence]) -> str:
        """The next eligible tenant in the ring after `tenant`."""
        i = self.ring.index(tenant)
        n = len(self.ring)
        return next(self.ring[(i + k) % n] for k in range(1, n + 1) if self.ring[(i + k) % n] in eligible)

    def _begin_turn(self, tenant: str, eligible: dict[str, Sequence], smallest: float) -> str:
        self.current = tenant
        self.deficit[tenant] += self.quantum * eligible[tenant].request.share / smallest
        return tenant

    def _keep(self, heads: dict[str, Sequence]) -> str | None:
        """Bring the ring up to date: tenants whose queue emptied leave it (and forfeit their deficit), new ones
        join at its end; a tenant kept waiting by priority keeps its place and its deficit. Returns the tenant
        whose turn begins now when the current one's queue emptied (the next in the ring), else None."""
        successor = None
        if self.current is not None and self.current not in heads and self.current in self.ring:
            i = self.ring.index(self.current)
            successor = next((t for t in self.ring[i + 1:] + self.ring[:i] if t in heads), None)
            self.current = None
        kept = [t for t in self.ring if t in heads]
        self.ring = kept + [t for t in heads if t not in kept]
        self.deficit = {t: self.deficit.get(t, 0.0) for t in self.ring}
        return successor


def split_step(wants: dict[str, int], shares: dict[str, float], batch: dict[str, bool], budget: int) -> dict[str, int]:
    """Prompt tokens each tenant may compute this step, out of `budget`: by weight (`shares`), interactive tenants
    (batch False) first, each capped at what it `wants`. Deterministic: ties go by the dicts' order."""
    caps = {t: 0 for t in wants}
    left = budget
    for is_batch in (False, True):  # strict priority, as in admission
        group = [t for t in wants if batch[t] == is_batch and wants[t] > 0]
        while group and left > 0:
            weight = sum(shares[t] for t in group)
            grants = [(t, min(wants[t] - caps[t], max(1, int(left * shares[t] / weight)))) for t in group]
            for t, grant in grants:  # each round either fills a tenant or spends all but a rounding remainder
                grant = min(grant, left)
                caps[t] += grant
                left -= grant
            group = [t for t in group if caps[t] < wants[t]]
    return caps
