"""Tenants at the Ray ingress: a flood of one never fills Ray's router queue for everyone else.

Behind Ray, a replica's own tenant admission (api/quotas.py) sees only what Ray's router hands it, at most
max_ongoing_requests, and Ray's router queue (max_queued_requests) is shared by every caller. A tenant flooding
past the deployment's admission therefore fills the replicas and Ray's queue with its own requests, and every
other tenant's next request is refused by Ray itself (429 `overloaded`), never reaching a replica that would have
admitted it.

So the ingress applies the keys file's rules that need the whole deployment, with the replicas' own counters
(quotas.TenantQuotas, one owner of those rules) over the deployment's admission: Ray's capacity, replicas x
max_ongoing_requests + max_queued_requests.

* the share of a nearly full deployment: past quotas.RESERVE_FROM of that capacity a tenant is admitted only
  below its weighted share of it; the rest is kept for the others. A refused request gets the tenant's own 429
  `tenant_share` / RESOURCE_EXHAUSTED, exactly as a replica would answer it;
* max_concurrent counts the tenant's requests across all replicas (each replica also holds it to the same
  limit, which can then never bind first).

The token-per-minute limits stay with the replicas, which see the tokens (the ingress relays bytes); behind Ray
a tenant's token limits are therefore per replica. A request with no key, or a key no tenant has, passes
uncounted: the replica answers it 401 at once. Without a keys file (one tenant or an open server) the ingress
counts nothing, and Ray's own bound is the only one, as before.

The keys file is read again when it changes on disk (checked at most once a second): the replicas reload theirs
on SIGHUP or on the same change.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Callable

from ..api.quotas import Load, TenantQuotas
from ..api.tenancy import Gate
from ..tenants import KeysFileError, Tenant, load_keys_file

RELOAD_CHECK_S = 1.0  # how often the keys file's modification time is looked at


class Ticket:
    """One admitted request's hold on its tenant's count; `close` releases it once, however often it is called
    (a stream's end, its client's disconnect and its garbage collection may all try)."""

    def __init__(self, shares: "IngressShares | None", tenant: Tenant | None) -> None:
        self._shares = shares  # None: nothing was counted (no keys file, or no tenant)
        self.tenant = tenant  # who it is, or None (no keys file; no key or an unknown one)

    def close(self) -> None:
        shares, self._shares = self._shares, None
        if shares is not None and self.tenant is not None:
            shares.release(self.tenant)

    def close_with(self, owner: Any) -> None:
        """Release when `owner` (a response body's generator) is garbage collected, if nothing closed it first: a
        generator that a disconnect discards before its first step never runs its `finally`."""
        weakref.finalize(owner, self.close)


UNCOUNTED = Ticket(None, None)


class IngressShares:
    """The ingress's per-tenant counters over the deployment's capacity."""

    def __init__(self, keys_file: str, capacity: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.gate = Gate(load_keys_file(keys_file), keys_file, metrics_public=False)  # raises KeysFileError
        self.capacity = capacity  # requests the deployment admits: replicas x max_ongoing + max_queued
        self.quotas = TenantQuotas(clock)
        self.clock = clock
        self.in_flight = 0  # counted requests of every tenant
        self._lock = threading.Lock()
        self._next_check = clock() + RELOAD_CHECK_S

    def admit(self, key: str) -> Ticket:
        """A ticket for a request carrying `key`, or Refused (tenant_share, tenant_concurrency) naming the limit."""
        self._reload_if_changed()
        tenant = self.gate.keyring.resolve(key) if self.gate.keyring is not None else None
        if tenant is None:
            return UNCOUNTED
        with self._lock:
            self.quotas.admit(tenant, 1, 0, Load(self.in_flight, self.capacity, self.gate.total_weight))
            self.in_flight += 1
        return Ticket(self, tenant)

    def release(self, tenant: Tenant) -> None:
        with self._lock:
            self.quotas.finished(tenant.name)
            self.in_flight = max(0, self.in_flight - 1)

    def _reload_if_changed(self) -> None:
        now = self.clock()
        if now < self._next_check:
            return
        self._next_check = now + RELOAD_CHECK_S
        if self.gate.changed_on_disk():
            try:
                self.gate.reload()
            except KeysFileError:  # the replicas keep their old keys too (api/tenancy.py): so does the ingress
                pass


def ingress_shares(keys_file: str, capacity: int) -> IngressShares | None:
    """The counters for --api-keys `keys_file` (None without one)."""
    return IngressShares(keys_file, capacity) if keys_file else None
