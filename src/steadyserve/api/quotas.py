"""Each tenant's own limits, counted where requests are admitted (ServerState.submit_all): the one owner of
max_concurrent and the tokens-per-minute limits of a keys file (steadyserve/tenants.py).

* max_concurrent: engine requests (choices) in flight; released when each one's final output arrives.
* prompt_tokens_per_minute / output_tokens_per_minute: a token bucket each, holding at most a minute's tokens
  and refilled continuously at the per-minute rate. Prompt tokens are taken when a request is admitted, output
  tokens as they are generated. A request is admitted while both of its tenant's buckets hold more than zero
  tokens, and may take a bucket below zero (a request's size is not known in advance: its output is counted as
  it comes); the tenant then waits out the debt. Over any window its use is at most the rate plus one minute's
  worth plus the requests it had in flight.

* the share of a nearly full server: past RESERVE_FROM of the server's capacity (--max-num-seqs + --max-queue)
  a tenant is admitted only while it holds less than its weighted share of that capacity (weight / the sum of
  the keys file's weights). Below it a lone tenant may use what is free; the rest is kept for the others, so a
  flood of one cannot take every seat from a tenant that sends one request a second. A server with one tenant
  (--api-key) keeps nothing back: at capacity it refuses with `overloaded`, as it always has.

A refusal names the limit (reason tenant_concurrency, tenant_prompt_tokens, tenant_output_tokens, tenant_share: 429 /
RESOURCE_EXHAUSTED) and carries the Retry-After of the tenant's own refill: when its bucket is back above zero,
or, for concurrency, when its own recent finish rate frees a seat. Other tenants' counters are untouched, so
they are still admitted. A tenant that a reload removed keeps its counters until its requests finish.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..limits import Refused
from ..tenants import Tenant

RECENT_FINISHES = 64  # a tenant's finish times kept, for its concurrency Retry-After
MIN_RETRY_S, MAX_RETRY_S = 1.0, 60.0  # the bounds of a Retry-After this module gives
RESERVE_FROM = 0.75  # the fraction of the server's capacity past which tenants get only their weighted share


@dataclass(frozen=True)
class Load:
    """The whole server's load at an admission, for the share of a nearly full server."""

    in_flight: int  # engine requests in flight, every tenant's
    capacity: int  # the most it admits: --max-num-seqs + --max-queue
    total_weight: float  # the sum of the weights of the tenants in force


@dataclass
class TokenBucket:
    """Tokens a tenant may still use: refilled at per_minute / 60 a second, up to per_minute."""

    per_minute: int  # refill rate per minute, and the most the bucket holds
    balance: float  # tokens left now (below zero: the debt of a request that took more than was left)
    updated: float  # when balance was last brought up to date (monotonic seconds)

    def refill(self, now: float) -> float:
        self.balance = min(float(self.per_minute), self.balance + (now - self.updated) * self.per_minute / 60.0)
        self.updated = now
        return self.balance

    def seconds_to_positive(self) -> float:
        """Seconds until the balance is above zero again (after refill)."""
        return max(0.0, -self.balance) * 60.0 / self.per_minute + 60.0 / self.per_minute


@dataclass
class TenantCounters:
    """One tenant's usage: what its limits are checked against."""

    in_flight: int = 0  # engine requests admitted and not yet finished
    finishes: deque = field(default_factory=lambda: deque(maxlen=RECENT_FINISHES))  # monotonic finish times
    prompt: TokenBucket | None = None  # with prompt_tokens_per_minute
    output: TokenBucket | None = None  # with output_tokens_per_minute


class TenantQuotas:
    """Counters per tenant name; safe from any thread (a lock around counter updates only)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._counters: dict[str, TenantCounters] = {}
        self._lock = threading.Lock()

    def _of(self, tenant: Tenant, now: float) -> TenantCounters:
        c = self._counters.setdefault(tenant.name, TenantCounters())
        c.prompt = _bucket(c.prompt, tenant.prompt_tokens_per_minute, now)
        c.output = _bucket(c.output, tenant.output_tokens_per_minute, now)
        return c

    def admit(self, tenant: Tenant, num_requests: int, prompt_tokens: int, load: Load | None = None) -> None:
        """Count `num_requests` engine requests with `prompt_tokens` in all for `tenant`, or raise Refused
        naming the limit it is past (nothing counted then). `load`: the server's, for the share of a nearly
        full server (None: not checked)."""
        now = self.clock()
        with self._lock:
            c = self._of(tenant, now)
            limit = tenant.max_concurrent
            if limit is not None and c.in_flight + num_requests > limit:
                asked = f"; {num_requests} asked for at once" if num_requests > 1 else ""
                raise Refused("tenant_concurrency", f"tenant {tenant.name!r} has {c.in_flight} requests in flight, "
                              f"its max_concurrent is {limit}{asked}; retry later",
                              retry_after=self._seat_wait(c, num_requests - (limit - c.in_flight), now))
            if load is not None and load.total_weight > tenant.weight and \
                    load.in_flight + num_requests > RESERVE_FROM * load.capacity:  # a sole tenant: no one to keep for
                share = load.capacity * tenant.weight / load.total_weight
                if c.in_flight + num_requests > share:
                    raise Refused("tenant_share", f"the server is nearly full ({load.in_flight} of {load.capacity} "
                                  f"requests in flight) and tenant {tenant.name!r} has {c.in_flight}, more than its "
                                  f"share ({share:.1f}, by weight); retry later",
                                  retry_after=self._seat_wait(c, max(1, round(c.in_flight + num_requests - share)),
                                                              now))
            for bucket, reason, what in ((c.prompt, "tenant_prompt_tokens", "prompt_tokens_per_minute"),
                                         (c.output, "tenant_output_tokens", "output_tokens_per_minute")):
                if bucket is not None and bucket.refill(now) <= 0:
                    raise Refused(reason, f"tenant {tenant.name!r} used its {what} ({bucket.per_minute}); "
                                  "retry later", retry_after=_bounded(bucket.seconds_to_positive()))
            c.in_flight += num_requests
            if c.prompt is not None:
                c.prompt.balance -= prompt_tokens

    def undo(self, tenant: Tenant, num_requests: int, prompt_tokens: int) -> None:
        """Take back an `admit` whose requests the engine then refused."""
        with self._lock:
            c = self._counters.get(tenant.name)
            if c is not None:
                c.in_flight = max(0, c.in_flight - num_requests)
                if c.prompt is not None:
                    c.prompt.balance = min(float(c.prompt.per_minute), c.prompt.balance + prompt_tokens)

    def generated(self, name: str, num_tokens: int) -> None:
        """Charge `num_tokens` generated tokens to tenant `name`'s output bucket (if it has one)."""
        with self._lock:
            c = self._counters.get(name)
            if c is not None and c.output is not None:
                c.output.refill(self.clock())
                c.output.balance -= num_tokens

    def finished(self, name: str, num_requests: int = 1) -> None:
        """`num_requests` of tenant `name`'s engine requests finished (or were never submitted after admit)."""
        with self._lock:
            c = self._counters.get(name)
            if c is not None:
                c.in_flight = max(0, c.in_flight - num_requests)
                c.finishes.append(self.clock())

    def in_flight(self, name: str) -> int:
        c = self._counters.get(name)
        return c.in_flight if c is not None else 0

    @staticmethod
    def _seat_wait(c: TenantCounters, seats: int, now: float) -> float:
        recent = [t for t in c.finishes if now - t < 30]
        if len(recent) < 2:
            return MIN_RETRY_S
        rate = len(recent) / max(now - recent[0], 1e-3)
        return _bounded(seats / rate)


def _bucket(bucket: TokenBucket | None, per_minute: int | None, now: float) -> TokenBucket | None:
    """The tenant's bucket under its current limit (a reload may have changed, added or removed it)."""
    if per_minute is None:
        return None
    if bucket is None:
        return TokenBucket(per_minute, float(per_minute), now)
    bucket.refill(now)
    bucket.per_minute = per_minute
    bucket.balance = min(bucket.balance, float(per_minute))
    return bucket


def _bounded(seconds: float) -> float:
    return min(MAX_RETRY_S, max(MIN_RETRY_S, seconds))
