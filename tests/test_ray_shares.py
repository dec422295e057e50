"""Tenants at the Ray ingress (steadyserve/ray/shares.py), without a cluster: a flooding tenant is held to its share
of the whole deployment's admission, so Ray's shared queue always has room for a tenant below its share; a tenant's
max_concurrent counts across replicas; every ticket is released once, also by a stream's body that a disconnect
discards unstarted. tests/test_ray_serve.py checks the same through a real cluster's proxies."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path

import pytest

from steadyserve.limits import Refused
from steadyserve.ray.app import deployment_capacity, engine_options, parse_serve_args, with_tenant_headroom
from steadyserve.ray.ingress import relay_events
from steadyserve.ray.shares import RELOAD_CHECK_S, IngressShares
from steadyserve.tenants import keys_file_entry

KEYS = {"A": "key-of-tenant-a-0123456789", "B": "key-of-tenant-b-0123456789", "C": "key-of-tenant-c-0123456789"}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def shares(tmp_path: Path, capacity: int, extra: dict[str, str] | None = None,
           clock: Clock | None = None) -> IngressShares:
    path = tmp_path / "keys.toml"
    path.write_text("\n".join(keys_file_entry(n, KEYS[n], (extra or {}).get(n, "")) for n in ("A", "B")))
    return IngressShares(str(path), capacity, clock=clock or Clock())


def fill(s: IngressShares, key: str) -> tuple[list, Refused]:
    """Admit `key`'s requests until one is refused: the tickets, and the refusal."""
    held = []
    while True:
        try:
            held.append(s.admit(key))
        except Refused as e:
            return held, e
        assert len(held) <= s.capacity, "never refused"


def test_a_flood_leaves_room_in_rays_queue_for_a_tenant_below_its_share(tmp_path: Path) -> None:
    """Capacity 96, equal weights: A alone is refused (its own tenant_share, with a Retry-After) once the deployment
    is three quarters full, and B is then admitted up to the deployment's capacity, which Ray would still admit.
    (Without the ingress's counters A takes all 96 and Ray refuses B: the first assertion fails with no limit.)"""
    s = shares(tmp_path, 96)
    a, refusal = fill(s, KEYS["A"])
    assert len(a) == 72 and refusal.reason == "tenant_share" and refusal.retry_after >= 1.0
    assert "'A'" in str(refusal) and "share" in str(refusal)
    b = [s.admit(KEYS["B"]) for _ in range(24)]
    assert s.in_flight == 96 and all(t.tenant.name == "B" for t in b)
    with pytest.raises(Refused, match="tenant_share|share"):
        s.admit(KEYS["A"])
    for t in a[:10]:  # A's requests finish: A stays above its share, so the freed room is B's
        t.close()
    with pytest.raises(Refused):
        s.admit(KEYS["A"])
    s.admit(KEYS["B"])


def test_every_ticket_is_released_once(tmp_path: Path) -> None:
    s = shares(tmp_path, 8)
    t = s.admit(KEYS["A"])
    t.close()
    t.close()
    assert s.in_flight == 0 and s.quotas.in_flight("A") == 0
    held, _ = fill(s, KEYS["A"])
    assert len(held) == 6  # 3/4 of 8


def test_max_concurrent_counts_across_replicas(tmp_path: Path) -> None:
    """A replica holds a tenant to max_concurrent among the requests Ray sent it; the ingress, to its requests on
    every replica."""
    s = shares(tmp_path, 1000, {"A": "max_concurrent = 3"})
    held, refusal = fill(s, KEYS["A"])
    assert len(held) == 3 and refusal.reason == "tenant_concurrency"
    held[0].close()
    s.admit(KEYS["A"])


def test_no_key_or_an_unknown_one_passes_uncounted(tmp_path: Path) -> None:
    """The replica answers those 401 at once: they hold no seat, and the ingress has no tenant to count them to."""
    s = shares(tmp_path, 4)
    for key in ("", "not-a-key", "Bearer " + KEYS["A"]):
        assert s.admit(key).tenant is None
    assert s.in_flight == 0


def test_a_changed_keys_file_is_read_again(tmp_path: Path) -> None:
    clock = Clock()
    s = shares(tmp_path, 100, clock=clock)
    assert s.admit(KEYS["C"]).tenant is None
    path = tmp_path / "keys.toml"
    path.write_text(path.read_text() + "\n" + keys_file_entry("C", KEYS["C"]))
    clock.now += RELOAD_CHECK_S
    assert s.admit(KEYS["C"]).tenant.name == "C"
    path.write_text("not toml [")  # a broken file: the keys in force stay, as on the replicas
    clock.now += RELOAD_CHECK_S
    assert s.admit(KEYS["C"]).tenant.name == "C"


def test_a_stream_body_releases_its_ticket_when_relayed_and_when_discarded_unstarted(tmp_path: Path) -> None:
    s = shares(tmp_path, 8)

    class Stream:
        def __init__(self) -> None:
            self.items = [b"data: {}\n\n", b"data: [DONE]\n\n"]

        def __aiter__(self) -> "Stream":
            return self

        async def __anext__(self) -> bytes:
            if not self.items:
                raise StopAsyncIteration
            return self.items.pop(0)

        def cancel(self) -> None:
            pass

    async def relay() -> bytes:
        return b"".join([c async for c in relay_events(Stream(), s.admit(KEYS["A"]))])

    assert asyncio.run(relay()).endswith(b"[DONE]\n\n") and s.in_flight == 0
    ticket = s.admit(KEYS["A"])
    body = relay_events(Stream(), ticket)
    ticket.close_with(body)
    assert s.in_flight == 1
    del body  # a client gone before the body's first step: its finally never runs
    gc.collect()
    assert s.in_flight == 0


def test_the_deployment_capacity_is_rays_admission() -> None:
    cfg = parse_serve_args(["--max-num-seqs", "16", "--max-queue", "16"])
    assert deployment_capacity(engine_options(cfg, {"num_replicas": 2})) == 2 * 32 + 32
    assert deployment_capacity(engine_options(cfg, {})) == 32 + 32
    auto = engine_options(cfg, {"autoscaling_config": {"min_replicas": 1, "max_replicas": 3}})
    assert deployment_capacity(auto) == 3 * 32 + 32
    assert deployment_capacity(engine_options(cfg, {"max_queued_requests": -1})) == 32


def test_with_keys_rays_queue_bound_sits_above_the_ingress_shares() -> None:
    """Ray counts a request until its replica reports it finished, after the ingress released it: without headroom
    its 429 `overloaded` comes first now and then, and falls on any tenant."""
    o = engine_options(parse_serve_args(["--max-num-seqs", "4", "--max-queue", "4"]), {})
    capacity = deployment_capacity(o)
    raised = with_tenant_headroom(o, capacity)
    assert capacity == 16 and raised["max_queued_requests"] == 8 + 4 and deployment_capacity(raised) == 20
    unbounded = {**o, "max_queued_requests": -1}
    assert with_tenant_headroom(unbounded, 8) == unbounded
