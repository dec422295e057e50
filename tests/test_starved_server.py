"""A real server with a busy neighbour (issue 40): it keeps answering, every stream ends with a finish reason,
and --adaptive-threads drops its thread count below the start value within a bounded number of requests.

Only what holds on any machine is asserted, no timing: every thread of the server and the neighbour (a
`while True: pass` loop, killed in a finally and bounded in time) are pinned onto the same two CPUs, so on a
machine of any size two server threads and one spinning one share two cores and wait on a run queue about a
third of the time, far above the policy's 10%. The model has SmolLM2's layer widths, whose matmuls run as
parallel regions on both threads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Iterator

import httpx
import pytest
from http_util import stream_completion

from steadyserve.engine.threads import REASON_RUN_DELAY, REASON_THROTTLED
from steadyserve.testing.server import ServerProcess

MAX_REQUESTS = 40  # a drop needs two starved 0.2 s windows of step time: a few 64-token requests
NEIGHBOUR_S = 300  # the neighbour kills itself after this, should the finally never run


@pytest.fixture(scope="module")
def server(smolwidth_model: str) -> Iterator[ServerProcess]:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs: with one, the budget is one thread and there is nothing to drop")
    with ServerProcess(smolwidth_model, "--stall-timeout", "60", threads=2) as s:
        yield s


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` onto `cpus` (threads it starts later inherit their creator's mask)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that has just ended
            pass


def neighbour(cpus: set[int]) -> subprocess.Popen:
    """One busy thread on `cpus`, for NEIGHBOUR_S seconds at most."""
    code = f"import os, time\nos.sched_setaffinity(0, {sorted(cpus)!r})\nt = time.monotonic()\n" \
           f"while time.monotonic() - t < {NEIGHBOUR_S}: pass\n"
    return subprocess.Popen([sys.executable, "-c", code])


def drops(s: ServerProcess) -> float:
    return (s.metric("steadyserve_thread_changes_total", reason=REASON_RUN_DELAY)
            + s.metric("steadyserve_thread_changes_total", reason=REASON_THROTTLED))


def test_a_busy_neighbour_drops_the_thread_count_and_every_stream_still_ends(server: ServerProcess):
    assert server.metric("steadyserve_threads_budget") == 2 == server.metric("steadyserve_threads")  # the start value
    start_drops = drops(server)
    cpus = set(sorted(os.sched_getaffinity(server.pid))[:2])
    pin(server.pid, cpus)
    spinners = [neighbour(cpus)]
    seen_threads, finish = [], []
    try:
        with httpx.Client(base_url=server.http_url, timeout=120) as c:
            for i in range(MAX_REQUESTS):
                r, chunks, done = stream_completion(c, "/v1/completions", {
                    "prompt": f"request {i}: the neighbour takes a core", "max_tokens": 64, "ignore_eos": True,
                    "temperature": 0.8, "seed": i})
                assert r.status_code == 200 and done, (i, r.status_code, chunks[-1:])
                reasons = [ch["choices"][0].get("finish_reason") for ch in chunks if ch.get("choices")]
                finish.append(reasons[-1])
                assert reasons[-1] in ("length", "stop"), (i, reasons[-3:])
                seen_threads.append(server.metric("steadyserve_threads"))
                if drops(server) > start_drops:
                    break
        wait = server.metric("steadyserve_engine_cpu_wait_seconds_total")
        print(f"\nrequests: {len(finish)}, threads seen after each: {seen_threads}, engine run-queue wait: "
              f"{wait:.3f} s, step time: {server.metric('steadyserve_step_duration_seconds_sum'):.3f} s")
        assert wait > 0, "the engine thread never waited on a run queue beside a busy neighbour"
        assert drops(server) > start_drops, (f"no drop in {MAX_REQUESTS} requests; threads seen {seen_threads}; "
                                             f"run-queue wait {wait} s")
        assert "engine threads changed" in server.logs()
        # The gauge reported the lower count (unless a probe had raised it again by the time it was read).
        assert min(seen_threads) < 2 or server.metric("steadyserve_thread_changes_total", reason="probe") > 0
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait()
        pin(server.pid, os.sched_getaffinity(0))
    # With the neighbour gone, the server answers as before (the count comes back by probing, not asserted).
    r = httpx.post(server.http_url + "/v1/completions", timeout=120,
                   json={"prompt": "quiet again", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop"), r.text
    assert 1 <= server.metric("steadyserve_threads") <= 2


def test_no_adaptive_threads_keeps_the_count(smolwidth_model: str):
    with ServerProcess(smolwidth_model, "--no-adaptive-threads", threads=2) as s:
        r = httpx.post(s.http_url + "/v1/completions", timeout=120,
                       json={"prompt": "pinned", "max_tokens": 16, "temperature": 0})
        assert r.status_code == 200, r.text
        assert s.metric("steadyserve_threads") == 2 == s.metric("steadyserve_threads_budget")
        assert drops(s) == 0 and "engine threads changed" not in s.logs()
