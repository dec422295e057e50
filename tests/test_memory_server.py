"""The memory limit against real servers (issue 33), on 127.0.0.1 with ephemeral ports and the tiny model.

* A budget larger than the machine's memory: the server exits 2 with one line naming the weights, the KV
  budget, the overhead and the limit with its source, having bound no port and allocated nothing large.
* `--kv-cache-memory auto` under a fixture cgroup v2 limit (TEST-ONLY --test-memory-root): the limit and its
  source are reported by /v1/models, GetModelInfo and steadyserve_memory_limit_bytes, the cache gets the
  expected number of blocks, and under 5x overload the peak RSS stays under the limit.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from steadyserve.client import Client
from steadyserve.config import EngineConfig
from steadyserve.engine.kv_cache import STORAGE, resolve_kv_dtype
from steadyserve.memory import AUTO_HEADROOM, SOURCE_CGROUP1, SOURCE_CGROUP2, SOURCE_MEMINFO, human
from steadyserve.models.loader import load_model
from steadyserve.testing.server import ServerProcess

MiB = 1024**2
LIMIT = 1200 * MiB  # the fixture cgroup's memory.max: room for the tiny model, 768 MiB overhead and ~310 MiB KV
MAX_SEQS, MAX_QUEUE = 4, 4  # capacity 8; the overload sends 5x that: 8 held, then 32 refused
HOLD = 3900  # tokens each held request would generate (4096 positions): it holds its seat until it is cancelled

# Runs the server as its only child and prints the child's peak RSS (KiB, from the kernel's accounting).
PEAK_RSS_WRAPPER = """
import resource, subprocess, sys
r = subprocess.run(sys.argv[1:], capture_output=True, text=True)
sys.stdout.write(r.stderr)
print("PEAK_RSS_KIB", resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "RC", r.returncode)
"""


def mem_total() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal")


def from_human(text: str) -> float:
    number, unit = text.split()
    return float(number) * 1024 ** ("B", "KiB", "MiB", "GiB", "TiB").index(unit)


def host_cgroup_limit() -> tuple[int, Path, str] | None:
    """(bytes, file, source) of the lowest memory limit of this process's cgroups (v2 memory.max, v1
    memory.limit_in_bytes, each up its ancestors) at the conventional mount points, or None: the test's own
    reading of the host, to hold the server's against. Unlimited values ("max", or v1's page-rounded 2**63 - 1)
    are no limit."""
    found = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and controllers == "":
            base, name, source = Path("/sys/fs/cgroup"), "memory.max", SOURCE_CGROUP2
            if (base / "unified").is_dir() and not (base / "cgroup.controllers").exists():
                base = base / "unified"  # hybrid layout: v2 mounted beside the v1 controllers
        elif "memory" in controllers.split(","):
            base, name, source = Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes", SOURCE_CGROUP1
        else:
            continue
        d = base / path.lstrip("/")
        d = d if d.is_dir() else base  # a namespaced mount shows our cgroup as its root
        for f in [d / name, *(p / name for p in d.parents if p == base or base in p.parents)]:
            value = f.read_text().strip() if f.is_file() else "max"
            if value != "max" and int(value) < 2**62:
                found.append((int(value), f, source))
    return min(found, default=None)


def test_budget_larger_than_the_machine_exits_with_one_line_before_allocating(tiny_model: str, tmp_path: Path):
    budget = 2 * mem_total()
    ready = tmp_path / "ready.json"
    argv = [sys.executable, "-m", "steadyserve.cli", "serve", "--model", tiny_model, "--threads", "1",
            "--http-port", "0", "--grpc-port", "0", "--ready-file", str(ready), "--kv-cache-memory", str(budget)]
    r = subprocess.run([sys.executable, "-c", PEAK_RSS_WRAPPER, *argv], capture_output=True, text=True, timeout=120)
    m = re.search(r"PEAK_RSS_KIB (\d+) RC (-?\d+)", r.stdout)
    assert m, r.stdout + r.stderr
    peak, rc = int(m.group(1)) * 1024, int(m.group(2))
    errors = [line for line in r.stdout.splitlines() if line.startswith("steadyserve: error:")]
    assert rc == 2 and len(errors) == 1, r.stdout
    line = errors[0]
    for term in ("memory budget does not fit", "weights ", f"KV cache {human(budget)}", "overhead 768.0 MiB"):
        assert term in line, (term, line)
    # The limit names its source, and the source is the one this host has (a CI runner in a memory-limited
    # container has a cgroup limit below MemAvailable; a plain machine or VM has none).
    m = re.search(r"> limit ([0-9.]+ [KMGT]?i?B) \(([^:]+): ([^)]*)\);", line)
    assert m, line
    limit_text, source, detail = m.groups()
    cgroup = host_cgroup_limit()
    if source == SOURCE_MEMINFO:
        assert detail.startswith("/proc/meminfo MemAvailable "), line
        assert cgroup is None or cgroup[0] >= from_human(limit_text) * 0.99, (cgroup, line)  # none lower
    else:
        assert cgroup is not None and source == cgroup[2], (cgroup, line)
        assert (detail, limit_text) == (str(cgroup[1]), human(cgroup[0])), (cgroup, line)
    assert not ready.exists()  # it never served
    assert peak < 1024 * MiB < budget, f"peak RSS {human(peak)} before refusing"  # nothing large allocated


@pytest.fixture(scope="module")
def cgroup_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cgroup v2 container with memory.max = LIMIT, on a machine with 64 GiB available."""
    root = tmp_path_factory.mktemp("cgroup-root")
    files = {"proc/self/cgroup": "0::/\n",
             "proc/self/mountinfo": "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
             "sys/fs/cgroup/memory.max": f"{LIMIT}\n",
             "proc/meminfo": f"MemTotal: {128 * 1024**2} kB\nMemAvailable: {64 * 1024**2} kB\n"}
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.fixture(scope="module")
def auto_server(long_model: str, cgroup_root: Path):
    """The tiny Llama with 4096 positions: requests long enough to hold every slot through a burst."""
    with ServerProcess(long_model, "--kv-cache-memory", "auto", "--max-num-seqs", str(MAX_SEQS),
                       "--max-queue", str(MAX_QUEUE), "--stall-timeout", "10", threads=1,
                       test_memory_root=str(cgroup_root)) as s:
        yield s


def test_auto_reports_the_limit_and_gets_the_expected_blocks(auto_server: ServerProcess, long_model: str):
    platform = httpx.get(auto_server.http_url + "/v1/models", timeout=30).json()["data"][0]["platform"]
    assert (platform["memory_limit_bytes"], platform["memory_limit_source"]) == (LIMIT, SOURCE_CGROUP2)
    with Client(auto_server.grpc_addr, timeout=30, retries=False) as c:
        g = c.model_info().platform
    assert (g.memory_limit_bytes, g.memory_limit_source) == (LIMIT, SOURCE_CGROUP2)
    assert auto_server.metric("steadyserve_memory_limit_bytes") == LIMIT
    # Blocks from the documented rule, with the weights measured here and the block size from config.json.
    cfg = json.loads((Path(long_model) / "config.json").read_text())
    loaded = load_model(long_model)  # the default path, as served
    fmt = resolve_kv_dtype("auto", loaded.dtype, loaded.numerics.mode)  # its cache format (kv_cache.py)
    per_block = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * STORAGE[fmt].itemsize \
        * EngineConfig().block_size
    weights = loaded.weights_bytes
    expected = (LIMIT - weights - EngineConfig().memory_overhead - int(LIMIT * AUTO_HEADROOM)) // per_block
    m = re.search(r"kv cache allocated .*?blocks=(\d+)", auto_server.logs())
    assert m and int(m.group(1)) == expected, auto_server.logs()[-3000:]
    assert "memory budget" in auto_server.logs() and "derived=True" in auto_server.logs()


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_auto_under_5x_overload_stays_under_the_limit(auto_server: ServerProcess):
    pid, peak, stop = auto_server.proc.pid, [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss(pid))
            time.sleep(0.02)

    async def one(client: httpx.AsyncClient, i: int, max_tokens: int) -> int:
        body = {"prompt": f"overload {i} " * 20, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.7,
                "seed": i}
        return (await client.post(auto_server.http_url + "/v1/completions", json=body, timeout=120)).status_code

    def gauges() -> tuple[float, float]:
        return (auto_server.metric("steadyserve_requests_running"),
                auto_server.metric("steadyserve_requests_waiting"))

    capacity = MAX_SEQS + MAX_QUEUE
    finished = lambda: sum(v for (name, _), v in auto_server.metrics().items()  # noqa: E731
                           if name == "steadyserve_requests_finished_total")

    async def hold(client: httpx.AsyncClient, i: int, status: list[int]) -> None:
        body = {"prompt": f"hold {i}", "max_tokens": HOLD, "ignore_eos": True, "stream": True}
        async with client.stream("POST", auto_server.http_url + "/v1/completions", json=body, timeout=120) as r:
            status.append(r.status_code)
            async for _ in r.aiter_bytes():
                pass

    async def storm() -> tuple[list[int], list[int], float, float]:
        """Fill every slot and the queue with streams that outlast the test (HOLD tokens), see the server's own
        gauges say so, then send 4x capacity more: each must be refused, deterministically. Then the held
        streams are cancelled (the client goes away; the server aborts them)."""
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=100)) as client:
            status: list[int] = []
            held = [asyncio.create_task(hold(client, i, status)) for i in range(capacity)]
            deadline = time.monotonic() + 60
            while await asyncio.to_thread(gauges) != (MAX_SEQS, MAX_QUEUE):
                assert not any(t.done() for t in held), [t.result() for t in held if t.done()]
                assert time.monotonic() < deadline, f"slots and queue not filled: {gauges()}"
                await asyncio.sleep(0.01)
            before = await asyncio.to_thread(finished)
            over = await asyncio.gather(*(one(client, i, 48) for i in range(capacity, 5 * capacity)))
            during = await asyncio.to_thread(finished)  # no held request ended: the slots stayed full throughout
            for t in held:
                t.cancel()
            await asyncio.gather(*held, return_exceptions=True)
        wait = time.monotonic() + 30
        while await asyncio.to_thread(gauges) != (0, 0):  # every held stream aborted: the server is idle again
            assert time.monotonic() < wait, gauges()
            await asyncio.sleep(0.05)
        return status, over, before, during

    rejected0 = auto_server.metric("steadyserve_requests_rejected_total", reason="overloaded")
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        held, over, before, during = asyncio.run(storm())
    finally:
        stop.set()
        sampler.join(5)
    assert held == [200] * capacity and over == [429] * (4 * capacity), (held, over)  # served, and overloaded
    assert before == during, "a held request finished during the burst: HOLD is too short for this machine"
    assert auto_server.metric("steadyserve_requests_rejected_total", reason="overloaded") - rejected0 == 4 * capacity
    print(f"\npeak RSS {human(peak[0])} under 5x overload, limit {human(LIMIT)}")
    assert 0 < peak[0] < LIMIT
