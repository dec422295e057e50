"""Issue 8, load and faults: the incidents in ../shared/incidents/ as tests against real servers.

* streaming storm: 250 concurrent SSE streams, 10% slow readers, 10% disconnecting (stream truncation incident)
* stalled reader: cut after --stall-timeout; other streams' inter-token latency stays within 2x unloaded
* overload: 5x measured capacity for 20 s over HTTP and gRPC at once (the ~200 RPS scoring incident)
* drain: SIGTERM during 50 streams over HTTP, WebSocket and gRPC (worker killed mid-stream incident)
* engine fault: one failing request fails alone; a dead engine loop ends streams with errors and exits non-zero

Every server runs on 127.0.0.1 with ephemeral ports and the tiny model; clients are real sockets. Each test
prints its figures (run pytest with -s). Tests synchronise on the server's counters and state, not on sleeps.
Timing bounds are kept only where they are the claim, and are relative (refusals faster than admitted work,
inter-token latency against the same machine unloaded) or generous upper bounds that only rule out a hang,
each with its margin documented: they must hold on any 2-core machine, faster or slower than this one.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from http_util import five_xx, post_request, status_counts, wait_for
from steadyserve.client import AsyncClient, logprobs_f32, pb
from steadyserve.limits import POOLED_IDLE_S
from steadyserve.testing import build_tiny_model
from steadyserve.testing.server import ServerProcess
from steadyserve.tools.sse_client import StreamResult, sse_post

KV = "64MiB"
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def model_4k(models_dir: Path) -> str:
    """The tiny model with 4096 positions (long streams, megabyte outputs for the stalled reader)."""
    return str(build_tiny_model(models_dir / "tiny-4k-reliability", max_position_embeddings=4096))


def model_bytes(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def rss_bound(model: str) -> int:
    """The documented RSS bound for the tiny model: model + --kv-cache-memory + 500 MiB."""
    return model_bytes(model) + 64 * MiB + 500 * MiB


def rss(server: ServerProcess) -> int:
    """The server's resident set, from /proc (cheap enough to sample every 100 ms)."""
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def idle(server: ServerProcess) -> bool:
    return server.metric("steadyserve_requests_running") == 0 and server.metric("steadyserve_requests_waiting") == 0


def batch_histogram(server: ServerProcess) -> tuple[float, float]:
    """(engine steps, sequences over those steps) of the server's steadyserve_batch_size."""
    return server.metric("steadyserve_batch_size_count"), server.metric("steadyserve_batch_size_sum")


def itl_histogram(server: ServerProcess) -> tuple[float, float]:
    """(count, sum) of the server's steadyserve_inter_token_latency_seconds."""
    return (server.metric("steadyserve_inter_token_latency_seconds_count"),
            server.metric("steadyserve_inter_token_latency_seconds_sum"))


def itl_window(before: tuple[float, float], after: tuple[float, float]) -> tuple[float, float]:
    """(tokens timed, mean seconds between tokens) between two itl_histogram readings."""
    n = after[0] - before[0]
    return n, (after[1] - before[1]) / max(n, 1)


def itls(results: list[StreamResult]) -> list[float]:
    return [b - a for r in results for a, b in zip(r.token_times, r.token_times[1:])]


def completion_tokens(r: StreamResult) -> int | None:
    """From the usage chunk (stream_options.include_usage) of an SSE stream."""
    usage = r.events[-1].get("usage") if r.events else None
    return usage["completion_tokens"] if usage else None


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


@pytest.fixture(scope="module")
def big(model_4k: str):
    """Room for the whole storm at once: 64 running + 256 queued."""
    with ServerProcess(model_4k, "--grpc-port", "-1", "--max-num-seqs", "64", "--max-queue", "256",
                       "--kv-cache-memory", KV, "--stall-timeout", "3", threads=1) as s:
        yield s


# ---- 1. streaming storm -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_streaming_storm_250_streams_slow_readers_and_disconnects(big, model_4k):
    wait_for(lambda: idle(big), 30, what="idle engine")
    url = big.http_url + "/v1/completions"
    n, kinds = 250, {}
    for i in range(n):
        kinds[i] = "slow" if i % 10 == 0 else "disconnect" if i % 10 == 1 else "normal"
    aborted0 = big.metric("steadyserve_streams_aborted_total", reason="client_disconnect")
    finished_abort0 = big.metric("steadyserve_requests_finished_total", finish_reason="abort")
    rss0 = rss(big)
    peak = [rss0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss(big))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    async def one(i: int) -> StreamResult:
        body = {"prompt": f"storm {i}: the quick brown fox", "max_tokens": 32, "ignore_eos": True,
                "temperature": 0.8, "seed": i, "stream": True}
        if kinds[i] == "slow":  # ~8 KB of events at 2 KB/s: 4 s of reading, never a 3 s pause
            return await sse_post(url, {**body, "logprobs": 2}, read_rate=2000, rcvbuf=4096, timeout=120)
        if kinds[i] == "disconnect":  # long enough to be surely mid-stream when we hang up
            return await sse_post(url, {**body, "max_tokens": 3000}, disconnect_after_events=3, timeout=120)
        return await sse_post(url, body, timeout=120)

    async def main() -> list[StreamResult]:
        return await asyncio.gather(*(one(i) for i in range(n)))

    t0 = time.monotonic()
    results = asyncio.run(main())
    wall = time.monotonic() - t0
    wait_for(lambda: idle(big), 30, what="every request finished or aborted in the engine")
    stop.set()
    sampler.join(5)
    rss1 = rss(big)
    by = {k: [r for i, r in enumerate(results) if kinds[i] == k] for k in ("normal", "slow", "disconnect")}
    truncated = sum(r.truncated or r.exception is not None for r in by["normal"] + by["slow"])
    non200 = [r.status for r in results if r.status != 200]
    aborted = big.metric("steadyserve_streams_aborted_total", reason="client_disconnect") - aborted0
    finished_abort = big.metric("steadyserve_requests_finished_total", finish_reason="abort") - finished_abort0
    bound = rss_bound(model_4k)
    print(f"\nstorm: {n} SSE streams ({len(by['normal'])} normal, {len(by['slow'])} slow at 2 KB/s, "
          f"{len(by['disconnect'])} disconnecting) in {wall:.1f} s; truncated {truncated}; non-200 {len(non200)}; "
          f"5xx {five_xx(big):.0f}; disconnects aborted in engine {aborted:.0f} (finished=abort {finished_abort:.0f}); "
          f"RSS {rss0 / MiB:.0f} -> peak {peak[0] / MiB:.0f} -> {rss1 / MiB:.0f} MiB (bound {bound / MiB:.0f} MiB); "
          f"slow streams took {min(r.token_times[-1] - r.t_start for r in by['slow']):.1f}.."
          f"{max(r.token_times[-1] - r.t_start for r in by['slow']):.1f} s")
    assert not non200, non200
    for r in by["normal"] + by["slow"]:
        assert r.exception is None and r.error is None, (r.exception, r.error)
        assert r.done and r.finish_reason == "length" and not r.truncated, r
    assert truncated == 0
    for r in by["disconnect"]:
        assert r.disconnected and not r.done
    # Each disconnect was counted and aborted in the engine: they asked for 3000 tokens, yet the engine is idle.
    # (steadyserve_requests_finished_total{finish_reason="abort"} is printed, not asserted: it counts only
    # final outputs some consumer read, and a disconnected stream's consumer is gone, so it undercounts.)
    assert aborted == len(by["disconnect"])
    assert five_xx(big) == 0, status_counts(big)
    assert peak[0] < bound and rss1 < bound


def test_rss_bound_trips_when_the_kv_cache_outgrows_its_budget(model_4k):
    """The storm's RSS bound has teeth: a server whose KV cache is ten times the budget the bound assumes
    (as a server that sized its cache from something other than --kv-cache-memory would be) is over it
    as soon as it is up, before any traffic. The cache is zero-filled at start-up, so its pages are resident."""
    with ServerProcess(model_4k, "--grpc-port", "-1", "--kv-cache-memory", "640MiB", threads=1) as s:
        resident = rss(s)
    bound = rss_bound(model_4k)
    print(f"\nKV 640 MiB against a bound built for 64 MiB: RSS {resident / MiB:.0f} MiB, bound {bound / MiB:.0f} MiB")
    assert resident > bound


# ---- 2. stalled reader ----------------------------------------------------------------------------------

def _stalled_reader(port: int) -> socket.socket:
    """A client that asks for megabytes (top-20 logprobs for 3000 tokens, ~0.7 KB each) and then reads nothing.

    Its prompt is short, so its compute per step is that of any other short stream: what the others feel is
    the stall, not a heavier sequence (test_http_streams covers a stalled reader with a long echoed prompt)."""
    body = json.dumps({"prompt": "stall here", "logprobs": 20, "max_tokens": 3000, "ignore_eos": True,
                       "stream": True}).encode()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(post_request(port, "/v1/completions", body))
    s.recv(512)  # the response head; then nothing more
    return s


def test_stalled_reader_is_cut_and_others_itl_stays_within_2x(big):
    wait_for(lambda: idle(big), 30, what="idle engine")
    url = big.http_url + "/v1/completions"
    stalls0 = big.metric("steadyserve_streams_aborted_total", reason="stall")

    async def streams(k: int = 4) -> list[StreamResult]:
        return await asyncio.gather(*(sse_post(url, {"prompt": f"itl {i}", "max_tokens": 48, "ignore_eos": True,
                                                     "stream": True}, timeout=60) for i in range(k)))

    asyncio.run(streams(2))  # warm-up
    h0 = itl_histogram(big)
    unloaded = itls(asyncio.run(streams()) + asyncio.run(streams()))
    h1 = itl_histogram(big)
    t0 = time.monotonic()
    stalled = _stalled_reader(big.http_port)
    try:
        # The stall proper: the socket buffers are full and the server's write is blocked (backlog grows).
        wait_for(lambda: big.metric("steadyserve_stream_backlog_bytes") > 64 * 1024, 20, interval=0.02,
                 what="the stalled stream's write blocked")
        stall_start = time.monotonic() - t0
        h2 = itl_histogram(big)
        during = asyncio.run(streams()) + asyncio.run(streams())
        h3 = itl_histogram(big)
        measured_until = time.monotonic() - t0
        inside = big.metric("steadyserve_streams_aborted_total", reason="stall") == stalls0
        cut = wait_for(lambda: big.metric("steadyserve_streams_aborted_total", reason="stall") == stalls0 + 1,
                       30, interval=0.02, what="stalled stream cut")
        cut_after = measured_until + cut
        wait_for(lambda: idle(big), 5, what="stalled request aborted in the engine")
    finally:
        stalled.close()
    # A second unloaded window, right after the stall: a neighbour on the shared cores that was busy beside the stall
    # is likely still busy here (one run failed at load 9-16 on 2 cores, the server's mean 1.5 ms before the stall and
    # 9.1 ms beside it: the neighbour had started between the two windows).
    h4 = itl_histogram(big)
    asyncio.run(streams())
    asyncio.run(streams())
    h5 = itl_histogram(big)
    loaded = itls(during)
    p50_u, p50_l = statistics.median(unloaded), statistics.median(loaded)
    # The server's own inter-token latency (steadyserve_inter_token_latency_seconds), over each window: the
    # comparison streams' tokens (and, beside the stall, the stalled request's own, generated until its cut).
    (n_u, mean_u), (n_l, mean_l) = itl_window(h0, h1), itl_window(h2, h3)
    mean_after = itl_window(h4, h5)[1]
    print(f"\nstalled reader: write blocked {stall_start:.2f} s after its request, cut at {cut_after:.2f} s "
          f"(--stall-timeout 3 s); comparison streams ran {stall_start:.2f}..{measured_until:.2f} s; other streams' "
          f"inter-token p50 {p50_u * 1000:.1f} ms unloaded -> {p50_l * 1000:.1f} ms beside the stalled reader "
          f"(ratio {p50_l / p50_u:.2f}, p90 {pct(unloaded, .9) * 1000:.1f} -> {pct(loaded, .9) * 1000:.1f} ms) at "
          f"the client; the server's mean {mean_u * 1000:.2f} ms ({n_u:.0f} tokens) -> {mean_l * 1000:.2f} ms "
          f"({n_l:.0f} tokens), ratio {mean_l / mean_u:.2f}; {mean_after * 1000:.2f} ms after the stall")
    assert all(r.done and r.finish_reason == "length" for r in during)
    assert inside, "the comparison streams outlasted the stall: nothing was measured beside it"
    # Never before --stall-timeout counted from the request (its writes cannot block before it is sent); the
    # upper bound only rules out a stall never cut: 3 s after the block was seen, plus 15 s for a slow machine.
    assert cut_after >= 3.0, cut_after
    assert cut_after - stall_start < 3.0 + 15
    # Within 2x unloaded, as the server measures it (its histogram, not this client's clock, which shares the 2
    # cores and its event loop with the streams it times): beside the stall, the batch is the same 4 comparison
    # streams plus the stalled one until its backlog fills, so a server whose blocked write held the engine or
    # the event loop would show it here. The 5 ms absolute slack: one tiny-model step is ~1-3 ms, and a
    # neighbour on a shared core can double a mean measured in milliseconds. The client's p50s are printed only.
    assert n_u >= 4 * 47 * 2 and n_l >= 4 * 47 * 2, (n_u, n_l)  # every comparison token was timed
    # Held against the slower of the unloaded windows before and after the stall, so a neighbour's load that came or
    # went between them is in the reference; a blocked write holding the engine would slow only the window beside it.
    assert mean_l <= 2 * max(mean_u, mean_after) + 0.005, (mean_u, mean_l, mean_after)


# ---- 3. overload over HTTP and gRPC at once -----------------------------------------------------------------

MAX_CLIENT_IN_FLIGHT = 128  # the overload client's open requests at most (half of them gRPC: < 256 streams)
PROBE = "The capital of France is Paris. Identical probes must score identically under any load."


@pytest.mark.slow
def test_overload_5x_capacity_http_and_grpc_for_20s(tiny_model):
    # 4 slots (2 running + 2 queued) and 48-token generations: capacity is low enough that one Python client
    # on 2 shared cores can offer 5x of it without becoming the bottleneck itself.
    with ServerProcess(tiny_model, "--max-num-seqs", "2", "--max-queue", "2", "--kv-cache-memory", KV,
                       threads=1) as srv:
        _overload(srv, tiny_model)


def _overload(srv: ServerProcess, model: str) -> None:
    body = {"prompt": "overload: tell me a story", "max_tokens": 48, "ignore_eos": True}

    async def http_one(c: httpx.AsyncClient) -> tuple[str, str, float]:
        t0 = time.perf_counter()
        try:
            r = await c.post("/v1/completions", json=body)
            return "http", str(r.status_code), time.perf_counter() - t0
        except httpx.HTTPError as e:
            return "http", f"{type(e).__name__}: {e}", time.perf_counter() - t0

    async def grpc_one(g: AsyncClient, probes: list, k: int) -> tuple[str, str, float]:
        """Every 4th gRPC call is the identical Score probe; the others generate 48 tokens."""
        t0 = time.perf_counter()
        try:
            if k % 4 == 0:
                probes.append(logprobs_f32(await g.score(PROBE, top_logprobs=2)))
            else:
                async for _ in g.generate("overload: a story", max_tokens=48, ignore_eos=True):
                    pass
            return "grpc", "OK", time.perf_counter() - t0
        except grpc.aio.AioRpcError as e:
            name = e.code().name
            return "grpc", name if name in ("RESOURCE_EXHAUSTED",) else f"{name}: {e.details()}", \
                time.perf_counter() - t0

    async def main():
        # The client keeps at most 128 idle connections, for at most POOLED_IDLE_S: the server closes its longest
        # idle one past --max-idle-connections (256) and any after HTTP_KEEP_ALIVE_S, and a request sent on a
        # connection in the instant the server closes it fails in the client (httpx.ReadError) before the server
        # read it. With 400 kept alive, CI once saw 2 such ReadErrors in the flood, once a flood's 429s left over
        # 256 connections idle.
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=128, keepalive_expiry=POOLED_IDLE_S)
        async with httpx.AsyncClient(base_url=srv.http_url, timeout=30, limits=limits) as c, \
                AsyncClient(srv.grpc_addr, timeout=30, retries=False) as g:
            probes: list[bytes] = []  # the probe's Scores taken under load only
            solo = logprobs_f32(await g.score(PROBE, top_logprobs=2))  # alone, before any load
            await c.get("/healthz")

            async def attempt(floor: float) -> tuple:
                # Capacity: a closed loop at exactly the server's admission capacity (4), for 5 s.
                done, t_end = 0, time.monotonic() + 5

                async def worker(k: int) -> None:
                    nonlocal done
                    i = 0
                    while time.monotonic() < t_end:
                        res = await (http_one(c) if k % 2 else grpc_one(g, probes, k * 1000 + i))
                        assert res[1] in ("200", "OK"), res
                        done += 1
                        i += 1

                t0 = time.monotonic()
                await asyncio.gather(*(worker(k) for k in range(4)))
                capacity = max(done / (time.monotonic() - t0), floor)
                # Offer 5x that, open loop, alternating HTTP and gRPC, for 20 s.
                rate, duration = 5 * capacity, 20.0
                tasks, rss_samples = [], []
                steps0 = batch_histogram(srv)
                t0 = time.monotonic()
                k = num_skipped = 0
                next_sample = t0
                # The client's own bound: a request due while MAX_CLIENT_IN_FLIGHT are still open is not sent. On a
                # 2-core box this one Python client can fall seconds behind its schedule; then its open calls pile up
                # past gRPC's 256 streams per connection (CI once saw 59 RST_STREAM REFUSED_STREAM at the HTTP/2
                # layer, with client-side refusal latencies of 5 s) and measure the client, not the server.
                in_flight = [0]

                def sent(task: asyncio.Task) -> asyncio.Task:
                    in_flight[0] += 1
                    task.add_done_callback(lambda _: in_flight.__setitem__(0, in_flight[0] - 1))
                    return task

                while (now := time.monotonic()) - t0 < duration:
                    due = int((now - t0) * rate)
                    while k < due:
                        if in_flight[0] >= MAX_CLIENT_IN_FLIGHT:
                            num_skipped += 1
                        else:
                            one = http_one(c) if k % 2 else grpc_one(g, probes, k // 2)
                            tasks.append(sent(asyncio.create_task(one)))
                        k += 1
                    if now >= next_sample:
                        rss_samples.append((now - t0, rss(srv)))
                        next_sample += 0.5
                    await asyncio.sleep(0.005)
                offered_s = time.monotonic() - t0
                steps1 = batch_histogram(srv)  # the engine's steps while the overload was offered
                results = await asyncio.gather(*tasks)
                print(f"\nthe client skipped {num_skipped} of {k} due requests (at most {MAX_CLIENT_IN_FLIGHT} open)")
                return capacity, rate, offered_s, results, rss_samples, steps0, steps1

            # The capacity is measured by a closed loop beside whatever else the 2 cores run (the other test worker
            # starting servers): measured while a neighbour was busy, it can be a fraction of what the server then
            # sustains (6.6 req/s measured, 28.5 admitted per second during the flood, once). A flood the server
            # admitted more than half of was not 5x its capacity: measure again and offer 5x that (at least 5x
            # what it admitted per second), once.
            floor = 0.0
            for _ in (1, 2):
                capacity, rate, offered_s, results, rss_samples, steps0, steps1 = await attempt(floor)
                admitted = sum(code in ("200", "OK") for _, code, _ in results)
                if admitted <= len(results) // 2:
                    break
                print(f"\nthe flood at {rate:.1f} req/s was not 5x capacity: {admitted} of {len(results)} admitted "
                      f"({admitted / offered_s:.1f} per second); measuring capacity again")
                floor = admitted / offered_s
            return capacity, rate, offered_s, results, rss_samples, probes, solo, steps0, steps1

    capacity, rate, offered_s, results, rss_samples, probes, solo, steps0, steps1 = asyncio.run(main())
    steps, seqs = steps1[0] - steps0[0], steps1[1] - steps0[1]
    codes: dict[str, int] = {}
    for tr, code, _ in results:
        codes[f"{tr}:{code}"] = codes.get(f"{tr}:{code}", 0) + 1
    refusals = sorted(s for _, code, s in results if code in ("429", "RESOURCE_EXHAUSTED"))
    admitted = sum(code in ("200", "OK") for _, code, _ in results)
    admitted_s = sorted(s for _, code, s in results if code in ("200", "OK"))
    warm = [v for t, v in rss_samples if t >= 5.0]
    ref = warm[0]
    distinct = len(set(probes))
    print(f"\noverload: capacity {capacity:.1f} req/s (4 slots; 48-token HTTP completions, gRPC Generate + "
          f"Score probes); offered "
          f"{rate:.1f} req/s for {offered_s:.1f} s = {len(results)} requests over HTTP+gRPC: {codes}; "
          f"admitted {admitted}, rejected {len(refusals)}; refusal latency p50 {pct(refusals, .5) * 1000:.1f} ms, "
          f"p95 {pct(refusals, .95) * 1000:.1f} ms, p99 {pct(refusals, .99) * 1000:.1f} ms, max "
          f"{refusals[-1] * 1000:.1f} ms; RSS after warm-up {ref / MiB:.0f} MiB, min {min(warm) / MiB:.0f}, max "
          f"{max(warm) / MiB:.0f} MiB (bound {rss_bound(model) / MiB:.0f}); {len(probes)} probe Scores -> "
          f"{distinct} distinct logprob vector(s)")
    assert set(codes) <= {"http:200", "http:429", "grpc:OK", "grpc:RESOURCE_EXHAUSTED"}, codes
    assert len(refusals) >= len(results) // 2, "5x capacity must be mostly refused"
    # Kept serving while refusing, as the engine counts it (steadyserve_batch_size, not a client's clock): while
    # the overload was offered, its steps ran with their 2 slots full (a finished request's slot is refilled
    # from the full queue at the next step). A server whose refusals starved admission, or whose engine stalled,
    # would step with empty slots or not at all. Admitted throughput against the closed-loop capacity is printed
    # only: the one Python client shares the 2 cores and measured itself (0.47 of capacity was seen once).
    print(f"admitted {admitted} = {admitted / (capacity * offered_s):.2f} of capacity x {offered_s:.1f} s; engine "
          f"{steps:.0f} steps, {seqs / max(steps, 1):.2f} sequences per step (2 slots)")
    assert steps >= 20 * offered_s and seqs / steps >= 1.75, (steps, seqs)
    # Refused at once, not after waiting for a slot: measured at the client (which shares the 2 cores with the
    # server), the refusals' median is below the median admitted request (a 48-token generation or a Score that
    # waited its turn), on a machine of any speed. The tails are printed, not asserted: they are the client's own
    # scheduling (CI once saw a refusal p95 of 133 ms against an admitted median of 117 ms). With a busy loop on
    # one of the 2 cores, this one client fell tens of seconds behind its own schedule while the server's
    # histograms had every Generate and completion handled within 1 s and its event-loop lag under 1 s.
    print(f"admitted latency p50 {pct(admitted_s, .5) * 1000:.1f} ms")
    for tr, refused in (("http", "429"), ("grpc", "RESOURCE_EXHAUSTED")):
        own = sorted(s for t, code, s in results if t == tr and code == refused)
        print(f"{tr} refusals: p50 {pct(own, .5) * 1000:.1f} ms, p95 {pct(own, .95) * 1000:.1f} ms, "
              f"max {own[-1] * 1000:.1f} ms; over 1 s: {sum(x > 1 for x in own)}")
    assert pct(refusals, .5) < pct(admitted_s, .5), (pct(refusals, .5), pct(admitted_s, .5))
    # RSS flat after warm-up: within 10% of the first warm sample (allocator noise here is 1-3%).
    assert all(abs(v - ref) <= 0.10 * ref for v in warm), [round(v / MiB) for v in warm]
    # Every probe scored under 5x overload has the very bits of the probe scored alone before it.
    assert len(probes) >= 5 and set(probes) == {solo}, (len(probes), distinct)
    assert five_xx(srv) == 0


# ---- 4. drain over HTTP, WebSocket and gRPC ----------------------------------------------------------------

async def _ws_stream(url: str, body: dict) -> tuple[list[dict], int | None]:
    msgs: list[dict] = []
    async with ws_connect(url, open_timeout=30, max_size=None) as ws:
        await ws.send(json.dumps(body))
        try:
            while True:
                msgs.append(json.loads(await asyncio.wait_for(ws.recv(), 120)))
        except ConnectionClosed:
            pass
        return msgs, ws.close_code


async def _grpc_stream(g: AsyncClient, text: str, n: int) -> tuple[list, str]:
    msgs = []
    try:
        async for m in g.generate(text, max_tokens=n, ignore_eos=True, temperature=0):
            msgs.append(m)
        return msgs, "OK"
    except grpc.aio.AioRpcError as e:
        return msgs, f"{e.code().name}: {e.details()}"


@pytest.mark.slow
def test_sigterm_drains_50_streams_over_http_ws_grpc(long_model):
    # Long enough that the 50 streams are still running when the signal lands and after the refusal checks
    # (well under 1 s), on a fast machine too: 1000 tokens at batch 50 are many seconds of steps here.
    n_tokens, drain_timeout = 1000, 120
    with ServerProcess(long_model, "--max-num-seqs", "64", "--max-queue", "16", "--kv-cache-memory", KV,
                       "--drain-timeout", str(drain_timeout), threads=1) as srv:
        ws_url = f"ws://127.0.0.1:{srv.http_port}/v1/stream"
        body = {"prompt": "drain me gently", "max_tokens": n_tokens, "ignore_eos": True}
        usage = {"stream_options": {"include_usage": True}}

        async def main():
            async with AsyncClient(srv.grpc_addr, timeout=120, retries=False) as g, \
                    httpx.AsyncClient(base_url=srv.http_url, timeout=10) as c:
                sse = [asyncio.create_task(sse_post(srv.http_url + "/v1/completions",
                                                    {**body, **usage, "stream": True}, timeout=120)) for _ in range(20)]
                wss = [asyncio.create_task(_ws_stream(ws_url, body)) for _ in range(15)]
                grs = [asyncio.create_task(_grpc_stream(g, body["prompt"], n_tokens)) for _ in range(15)]
                t_wait = time.monotonic()
                # Admitted (counted on the loop at submit) and seen by the engine (its gauges move between
                # steps, so they lag admission by up to one step).
                in_flight = 0.0
                while (sum(srv.metric("steadyserve_requests_admitted_total", transport=t)
                           for t in ("http", "ws", "grpc")) < 50 or in_flight < 50):
                    assert time.monotonic() - t_wait < 60, "50 streams not admitted"
                    await asyncio.sleep(0.05)
                    in_flight = (srv.metric("steadyserve_requests_running")
                                 + srv.metric("steadyserve_requests_waiting"))
                t_sig = time.monotonic()
                srv.signal(signal.SIGTERM)
                flips: dict[str, float] = {}
                while len(flips) < 2 and time.monotonic() - t_sig < 5:
                    if "readyz" not in flips and (await c.get("/readyz")).status_code == 503:
                        flips["readyz"] = time.monotonic() - t_sig
                    if "grpc" not in flips and await g.health() == "NOT_SERVING":
                        flips["grpc"] = time.monotonic() - t_sig
                    await asyncio.sleep(0.005)
                # New work is refused on every transport while the 50 finish.
                r = await c.post("/v1/completions", json={"prompt": "new", "max_tokens": 2})
                new_http = (r.status_code, r.json()["error"]["code"], r.headers.get("retry-after"))
                new_ws = await _ws_stream(ws_url, {"prompt": "new", "max_tokens": 2})
                try:
                    await g.score("new")
                    new_grpc = "OK"
                except grpc.aio.AioRpcError as e:
                    new_grpc = e.code().name
                still_running = sum(not t.done() for t in sse + wss + grs)
                return (await asyncio.gather(*sse), await asyncio.gather(*wss), await asyncio.gather(*grs),
                        t_sig, flips, new_http, new_ws, new_grpc, in_flight, still_running)

        sse, wss, grs, t_sig, flips, new_http, new_ws, new_grpc, in_flight, still_running = asyncio.run(main())
        code = srv.wait(drain_timeout + 10)
        exited = time.monotonic() - t_sig
        ok_sse = sum(r.done and r.finish_reason == "length" and completion_tokens(r) == n_tokens for r in sse)
        ok_ws = sum(code_ == 1000 and m[-1]["type"] == "final" and m[-1]["usage"]["completion_tokens"] == n_tokens
                    for m, code_ in wss)
        ok_grpc = sum(st == "OK" and ms[-1].final.usage.completion_tokens == n_tokens for ms, st in grs)
        print(f"\ndrain: SIGTERM with {in_flight:.0f} in flight (20 SSE, 15 WS, 15 gRPC; {still_running} still "
              f"streaming after the refusal checks); /readyz 503 after {flips.get('readyz', -1) * 1000:.0f} ms, "
              f"gRPC health NOT_SERVING after {flips.get('grpc', -1) * 1000:.0f} ms; new requests: HTTP "
              f"{new_http[0]}, WS close {new_ws[1]}, gRPC {new_grpc}; completed {ok_sse}+{ok_ws}+{ok_grpc}/50; "
              f"exit {code} after {exited:.1f} s (drain timeout {drain_timeout} s)")
        assert in_flight == 50 and still_running > 0, "SIGTERM did not land mid-stream"
        # Both flip while the 50 streams are still running (still_running > 0 above was measured after the flips
        # and the refusal checks); the times are printed. The 5 s polling limit only rules out a hang.
        assert set(flips) == {"readyz", "grpc"}, flips
        assert new_http[0] == 503 and new_http[1] == "draining" and new_http[2]
        assert new_ws[1] == 1013 and new_ws[0][-1]["error"]["code"] == "draining" and new_ws[0][-1]["status"] == 503
        assert new_grpc == "UNAVAILABLE"
        assert (ok_sse, ok_ws, ok_grpc) == (20, 15, 15), ([r.error for r in sse], [m[-1] for m, _ in wss], grs)
        assert code == 0 and exited < drain_timeout


# ---- 5. engine faults (test-only hook: steadyserve.testing.serve --test-faults) ----------------------------------------

@pytest.mark.slow
def test_failing_request_fails_alone_and_dead_engine_exits_nonzero(tiny_model):
    with ServerProcess(tiny_model, "--max-num-seqs", "16", "--kv-cache-memory", KV, threads=1,
                       test_faults=True) as srv:
        assert "TEST-ONLY fault injection is ON" in srv.logs()
        ws_url = f"ws://127.0.0.1:{srv.http_port}/v1/stream"
        url = srv.http_url + "/v1/completions"
        ok = {"prompt": "a normal request", "max_tokens": 40, "ignore_eos": True}
        bad = {"prompt": "this one <<fail-request>> fails", "max_tokens": 40, "ignore_eos": True}

        async def part1():
            async with AsyncClient(srv.grpc_addr, timeout=60, retries=False) as g:
                return await asyncio.gather(
                    sse_post(url, {**ok, "stream": True, "stream_options": {"include_usage": True}}),
                    # logprobs: each token is counted even when its text is held back as part of a
                    # character (unseeded sampling on the tiny model sometimes starts with such pieces).
                    sse_post(url, {**bad, "stream": True, "logprobs": 0}),
                    _ws_stream(ws_url, ok), _ws_stream(ws_url, bad),
                    _grpc_stream(g, ok["prompt"], 40), _grpc_stream(g, bad["prompt"], 40))

        sse_ok, sse_bad, (ws_ok, ws_ok_code), (ws_bad, ws_bad_code), (gr_ok, gr_ok_st), (gr_bad, gr_bad_st) = \
            asyncio.run(part1())
        print(f"\nengine fault, one request: SSE error {sse_bad.error}; WS close {ws_bad_code} {ws_bad[-1]}; "
              f"gRPC {gr_bad_st}")
        assert sse_ok.done and sse_ok.finish_reason == "length" and completion_tokens(sse_ok) == 40
        assert sse_bad.done and sse_bad.error["code"] == "request_error" and "test fault" in sse_bad.error["message"]
        assert sse_bad.num_tokens >= 1 and sse_bad.finish_reason is None  # failed mid-stream, said so
        assert ws_ok_code == 1000 and ws_ok[-1]["usage"]["completion_tokens"] == 40
        assert ws_bad_code == 1008 and ws_bad[-1]["type"] == "error" and ws_bad[-1]["error"]["code"] == "request_error"
        assert gr_ok_st == "OK" and gr_ok[-1].final.usage.completion_tokens == 40
        assert gr_bad_st.startswith("ABORTED") and "test fault" in gr_bad_st
        assert httpx.get(srv.http_url + "/readyz").status_code == 200
        assert srv.metric("steadyserve_engine_alive") == 1 and five_xx(srv) == 0

        # The engine loop itself dies: streams in flight on every transport get error events, health goes
        # NOT_SERVING, the process exits non-zero within seconds.
        long = {"prompt": "a long one", "max_tokens": 450, "ignore_eos": True}

        async def part2():
            async with AsyncClient(srv.grpc_addr, timeout=60, retries=False) as g:
                watch = g.health_stub.Watch(health_pb2.HealthCheckRequest(), timeout=60)
                first = await watch.read()
                tasks = [asyncio.create_task(sse_post(url, {**long, "stream": True})),
                         asyncio.create_task(_ws_stream(ws_url, long)),
                         asyncio.create_task(_grpc_stream(g, long["prompt"], 450))]
                started = time.monotonic()
                while srv.metric("steadyserve_requests_running") < 3:  # all three streams are generating
                    assert time.monotonic() - started < 60, (srv.metric("steadyserve_requests_running"),
                                                             [t.result() for t in tasks if t.done()])
                    await asyncio.sleep(0.02)
                t_kill = time.monotonic()
                async with httpx.AsyncClient(timeout=30) as c:
                    killer = await c.post(url, json={"prompt": "<<kill-engine>>", "max_tokens": 4})
                statuses = [first.status]
                while statuses[-1] != health_pb2.HealthCheckResponse.NOT_SERVING:
                    statuses.append((await watch.read()).status)
                not_serving = time.monotonic() - t_kill
                watch.cancel()
                return await asyncio.gather(*tasks), killer, t_kill, not_serving, statuses

        (sse_r, (ws_m, ws_code), (gr_m, gr_st)), killer, t_kill, not_serving, statuses = asyncio.run(part2())
        code = srv.wait(30)
        exited = time.monotonic() - t_kill
        print(f"engine death: killer request HTTP {killer.status_code}; health NOT_SERVING after "
              f"{not_serving * 1000:.0f} ms; SSE error {sse_r.error and sse_r.error['code']} after "
              f"{sse_r.num_tokens} tokens; WS close {ws_code} {ws_m[-1].get('error', {}).get('code')}; gRPC "
              f"{gr_st.split(':')[0]}; exit code {code} after {exited:.2f} s")
        assert killer.status_code == 500 and killer.json()["error"]["code"] == "engine_error"
        assert sse_r.done and sse_r.error["code"] == "engine_error" and sse_r.num_tokens < 450
        assert ws_code == 1011 and ws_m[-1]["type"] == "error" and ws_m[-1]["error"]["code"] == "engine_error"
        assert gr_st.startswith("INTERNAL") and len(gr_m) >= 1
        # "Within seconds": NOT_SERVING and the exit come from the loop's death, not from a timeout (the streams
        # have a 60 s deadline); 10 s and 20 s leave a slow machine room and still rule out waiting for those.
        assert statuses[0] == health_pb2.HealthCheckResponse.SERVING and not_serving < 10.0
        assert code == 3 and exited < 20
        assert "engine loop died" in srv.logs()
