"""Many teams on one server (issue 61): does one tenant's flood take another's service?

Starts `steadyserve serve` on 127.0.0.1 with the default model (SmolLM2-135M-Instruct; --model to override) and a
keys file, and runs, each phase for a bounded time, with sampled text (temperature 0.8, a seed per request):

  quiet      tenant B alone, one streamed request a second for --b-seconds: B's TTFT on a quiet server
  single     tenant A alone floods (--flood x --max-num-seqs streams kept open): the single-tenant throughput
  contended  A floods while B sends one request a second (equal weights): B's TTFT p99 against quiet (target
             <= 2x), B's 429s (target 0), whether every refusal A got is A's own 429, throughput against single
             (target within 10%). Single and contended alternate over --rounds rounds (single, contended,
             contended, single, ...), --b-seconds in all for each, so a drift of the machine falls on both
  shares     the keys file reloaded (SIGHUP) to C (weight 3) and D (weight 1), both flooding: output tokens C:D
             over --shares-seconds (target 3:1 within 10%)
  kv_full    a second server with a small --kv-cache-memory, A `batch` flooding with long outputs, B `interactive`
             one a second: B is never refused, A's sequences are preempted instead

Output tokens are read from the server's own per-tenant counters (steadyserve_tenant_tokens_total), so the client's
event coalescing cannot skew them. B's requests come from a process of their own, with its own event loop: in the
flooding client's loop, B's first token waited behind the parsing of A's 40 streams, and the client timed itself.
B's TTFT p99 is taken over --b-seconds (default 120: 120 requests, so the p99 is not simply the slowest of 30), and
the server's own view of it (steadyserve_tenant_time_to_first_token_seconds, admission to first token) is reported
beside it. Results go to benchmarks/results/tenants.json, with the CPU and the load
average before and after (another process on the machine skews every number here).

    .venv/bin/python benchmarks/tenants.py                      # about 9 minutes
    .venv/bin/python benchmarks/tenants.py --phase-seconds 10 --b-seconds 20 --shares-seconds 30   # a quicker look
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import datetime
import json
import multiprocessing
import os
import platform
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

from steadyserve.tenants import keys_file_entry
from steadyserve.testing.server import ServerProcess
from steadyserve.tools.sse_client import StreamResult, sse_post

RESULTS = Path(__file__).parent / "results" / "tenants.json"
KEYS = {name: f"bench-key-{name}-" + "k" * 16 for name in "ABCD"}
STEP = "steadyserve_step_duration_seconds"


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def keys_toml(entries: dict[str, str]) -> str:
    """A keys file: tenant name -> extra TOML lines (A always has the admin role, to read /metrics)."""
    out = []
    for name, extra in entries.items():
        roles = 'roles = ["admin"]\n' if name == "A" else ""
        out.append(keys_file_entry(name, KEYS[name], roles + extra))
    return "\n".join(out)


def output_tokens(srv: ServerProcess) -> Counter:
    """Output tokens so far per tenant, from the server's counters."""
    got: Counter = Counter()
    for line in srv.metrics_text({"Authorization": f"Bearer {KEYS['A']}"}).splitlines():
        if line.startswith("steadyserve_tenant_tokens_total{") and 'kind="output"' in line:
            tenant = line.split('tenant="', 1)[1].split('"', 1)[0]
            got[tenant] += float(line.rsplit(" ", 1)[1])
    return got


def metric(srv: ServerProcess, name: str) -> float:
    for line in srv.metrics_text({"Authorization": f"Bearer {KEYS['A']}"}).splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def histogram(srv: ServerProcess, name: str) -> dict[str, float]:
    """A histogram's cumulative buckets ("le" -> count), "sum" and "count", unlabelled series only."""
    got: dict[str, float] = {}
    for line in srv.metrics_text({"Authorization": f"Bearer {KEYS['A']}"}).splitlines():
        if line.startswith(name + "_bucket{le="):
            got[line.split('le="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
        elif line.startswith((name + "_sum ", name + "_count ")):
            got[line.split()[0].rsplit("_", 1)[1]] = float(line.split()[1])
    return got


def steps_between(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The engine's steps in a phase, from two reads of steadyserve_step_duration_seconds: how many, their mean, and
    the share of them at most 25, 50 and 100 ms (the floor under a first token: a request arriving mid-step waits
    for that step, then computes its prompt in the next)."""
    n = after.get("count", 0) - before.get("count", 0)
    share = {f"le_{int(float(le) * 1000)}ms": round((after[le] - before.get(le, 0)) / n, 3) if n else None
             for le in ("0.025", "0.05", "0.1") if le in after}
    took = after.get("sum", 0) - before.get("sum", 0)
    return {"steps": int(n), "mean_ms": round(1000 * took / n, 1) if n else None, **share}


class Usage:
    """Where a phase's CPU went: the server process, this (flooding) client, B's client process, and how long the
    engine thread waited on a run queue (the server's own steadyserve_engine_cpu_wait_seconds_total). On a 2-core
    machine every CPU-second a client takes is one the engine's two threads did not have."""

    def __init__(self, srv: ServerProcess, pool: concurrent.futures.ProcessPoolExecutor | None) -> None:
        self.srv, self.pool = srv, pool
        self.t0, self.cpu0 = time.monotonic(), self._cpu()

    def _cpu(self) -> dict[str, float]:
        def seconds(pid: int) -> float:
            try:
                t = psutil.Process(pid).cpu_times()
                return t.user + t.system
            except psutil.Error:
                return 0.0
        me = os.times()
        pool = sum(seconds(pid) for pid in getattr(self.pool, "_processes", None) or {})
        return {"server": seconds(self.srv.proc.pid), "flood_client": me.user + me.system, "b_client": pool,
                "engine_cpu_wait": metric(self.srv, "steadyserve_engine_cpu_wait_seconds_total"),
                "thread_changes": sum(float(line.rsplit(" ", 1)[1]) for line in self.srv.metrics_text(
                    {"Authorization": f"Bearer {KEYS['A']}"}).splitlines()
                    if line.startswith("steadyserve_thread_changes_total{"))}

    def done(self) -> dict[str, float]:
        """CPU-seconds per second of the phase (1.0 = one core busy), and the thread changes made in it."""
        took, now = time.monotonic() - self.t0, self._cpu()
        out = {f"{k}_cpus": round((now[k] - self.cpu0[k]) / took, 3) for k in now if k != "thread_changes"}
        out["thread_changes"] = now["thread_changes"] - self.cpu0["thread_changes"]
        return out


def p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))], 4)


class Load:
    """Streams of one tenant, with every outcome kept: TTFTs, statuses and error codes."""

    def __init__(self, url: str, tenant: str, max_tokens: int) -> None:
        self.url, self.tenant, self.max_tokens = url, tenant, max_tokens
        self.ttft: list[float] = []
        self.status: Counter = Counter()
        self.codes: Counter = Counter()
        self.n = 0

    async def one(self) -> StreamResult:
        self.n += 1
        seed = hash((self.tenant, self.n)) % 2**31
        body = {"prompt": f"Request {self.n} from team {self.tenant}: write a short note about", "stream": True,
                "max_tokens": self.max_tokens, "temperature": 0.8, "seed": seed, "ignore_eos": True}
        r = await sse_post(self.url + "/v1/completions", body,
                           headers={"Authorization": f"Bearer {KEYS[self.tenant]}"}, timeout=300)
        self.status[r.status] += 1
        if r.status == 200 and r.token_times:
            self.ttft.append(r.token_times[0] - r.t_start)
        if r.error:
            self.codes[str(r.error.get("code"))] += 1
        return r

    async def flood(self, streams: int, until: float) -> None:
        """Keep `streams` requests in flight until `until`; a refused one is retried after its Retry-After (at
        most a second) as a real client would."""

        async def worker() -> None:
            while time.monotonic() < until:
                r = await self.one()
                if r.status != 200:
                    await asyncio.sleep(min(1.0, float(r.headers.get("retry-after", "1"))))

        await asyncio.gather(*(worker() for _ in range(streams)))

    async def every_second(self, until: float) -> None:
        tasks = []
        while time.monotonic() < until:
            tasks.append(asyncio.create_task(self.one()))
            await asyncio.sleep(1.0)
        await asyncio.gather(*tasks)

    def raw(self) -> dict[str, Any]:
        """What it saw, unsummarised: a Load in another process hands this back to be merged."""
        return {"n": self.n, "ttft": self.ttft, "status": dict(self.status), "codes": dict(self.codes)}

    def merge(self, raw: dict[str, Any]) -> None:
        self.n += raw["n"]
        self.ttft += raw["ttft"]
        self.status.update(raw["status"])
        self.codes.update(raw["codes"])

    def summary(self) -> dict[str, Any]:
        return {"requests": self.n, "status": dict(self.status), "error_codes": dict(self.codes),
                "ttft_p50_s": p(self.ttft, 0.5), "ttft_p99_s": p(self.ttft, 0.99), "ttft_max_s": p(self.ttft, 1.0)}


def _every_second_alone(url: str, tenant: str, max_tokens: int, seconds: float) -> dict[str, Any]:
    """In a process of its own: one streamed request a second for `seconds`; what it saw (Load.raw)."""
    load = Load(url, tenant, max_tokens)
    asyncio.run(load.every_second(time.monotonic() + seconds))
    return load.raw()


async def every_second_elsewhere(pool: concurrent.futures.Executor, srv: ServerProcess, load: Load,
                                 seconds: float) -> None:
    """`load.every_second` in the pool's process (its own event loop), while this loop drives the flood; what it saw
    is merged into `load`."""
    load.merge(await asyncio.get_running_loop().run_in_executor(pool, _every_second_alone, srv.http_url, load.tenant,
                                                                load.max_tokens, seconds))


def tenant_ttft(srv: ServerProcess, tenant: str) -> dict[str, float]:
    """The server's TTFT histogram of one tenant (admission to first token): cumulative buckets, sum and count."""
    name, got = "steadyserve_tenant_time_to_first_token_seconds", {}
    for line in srv.metrics_text({"Authorization": f"Bearer {KEYS['A']}"}).splitlines():
        if line.startswith(name) and f'tenant="{tenant}"' in line:
            if line.startswith(name + "_bucket"):
                got[line.split('le="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
            elif line.startswith((name + "_sum", name + "_count")):
                got[line.split("{", 1)[0].rsplit("_", 1)[1]] = float(line.rsplit(" ", 1)[1])
    return got


def ttft_between(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """One tenant's TTFTs in a phase as the server measured them: how many, their mean, the share within 50, 100 and
    250 ms (the histogram's buckets: no finer percentile can be read from it)."""
    n = after.get("count", 0) - before.get("count", 0)
    share = {f"le_{int(float(le) * 1000)}ms": round((after[le] - before.get(le, 0)) / n, 3) if n else None
             for le in ("0.05", "0.1", "0.25") if le in after}
    took = after.get("sum", 0) - before.get("sum", 0)
    return {"requests": int(n), "mean_ms": round(1000 * took / n, 1) if n else None, **share}


def request_lines(logs: str, tenant: str) -> list[dict[str, Any]]:
    """The server's "request done" lines of one tenant (JSON log format) in `logs`."""
    got = []
    for line in logs.splitlines():
        if '"request done"' in line:
            rec = json.loads(line)
            if rec.get("tenant") == tenant:
                got.append(rec)
    return got


def split(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Percentiles of where the requests' time to first token went: the queue (admission to the first step that
    scheduled it: the step in progress when it arrived), the engine's steps from there to its first token, and
    the event loop's handling of that token."""
    parts: dict[str, list[float]] = {"queue_ms": [], "steps_ms": [], "loop_ms": []}
    for r in lines:
        if r.get("ttft_s") is None or r.get("engine_ttft_s") is None:
            continue
        parts["queue_ms"].append(1000 * r["queue_s"])
        parts["steps_ms"].append(1000 * (r["engine_ttft_s"] - r["queue_s"]))
        parts["loop_ms"].append(1000 * (r["ttft_s"] - r["engine_ttft_s"]))
    return {k: {f"p{int(q * 100)}": round(p(v, q) or 0, 1) for q in (0.5, 0.9, 0.99)} for k, v in parts.items()}


def slowest(lines: list[dict[str, Any]], n: int = 5) -> list[dict[str, Any]]:
    """The `n` requests of longest server-side TTFT, split where their wait was: the queue (admission to the first
    step that scheduled it), the engine (to the step that emitted the first token), the event loop (to its
    handling of that token)."""
    timed_ = sorted((r for r in lines if r.get("ttft_s") is not None), key=lambda r: r["ttft_s"], reverse=True)
    return [{"ttft_ms": round(1000 * r["ttft_s"], 1), "queue_ms": round(1000 * (r.get("queue_s") or 0), 1),
             "engine_ttft_ms": round(1000 * (r.get("engine_ttft_s") or 0), 1),
             "preemptions": r.get("preemptions")} for r in timed_[:n]]


async def timed(srv: ServerProcess, coros: list, seconds: float) -> tuple[Counter, float]:
    """Run the loads for `seconds` (their requests then finish); output tokens per tenant within the window."""
    t0, before = time.monotonic(), output_tokens(srv)
    await asyncio.gather(*coros)
    took = time.monotonic() - t0
    after = output_tokens(srv)
    return Counter({t: after[t] - before[t] for t in after}), took


async def single_and_contended(a: argparse.Namespace, srv: ServerProcess,
                               pool: concurrent.futures.Executor) -> tuple[dict[str, Any], dict[str, Any]]:
    """A flooding alone (single) and A flooding while B sends one request a second (contended), interleaved over
    --rounds rounds of --b-seconds / --rounds each, in the order single, contended, contended, single, ... so a drift
    of the machine's speed during the run (another process starting, the CPU's clock) falls on both alike: run one
    after the other, two phases of the same server differed by more than the 10% the target allows."""
    span = a.b_seconds / a.rounds
    loads = {"single": Load(srv.http_url, "A", a.max_tokens), "contended": Load(srv.http_url, "A", a.max_tokens)}
    b = Load(srv.http_url, "B", a.max_tokens)
    got: dict[str, dict[str, Any]] = {k: {"tokens": Counter(), "seconds": 0.0, "rounds_tok_s": [], "steps": [],
                                          "cpu": [], "preemptions": 0.0} for k in loads}
    b_ttft0 = tenant_ttft(srv, "B")
    b_lines: list[dict[str, Any]] = []
    for r in range(a.rounds):
        for phase in (("single", "contended") if r % 2 == 0 else ("contended", "single")):
            until = time.monotonic() + span
            h0, preempted0, use = histogram(srv, STEP), metric(srv, "steadyserve_preemptions_total"), Usage(srv, pool)
            coros = [loads[phase].flood(a.flood * a.max_num_seqs, until)]
            if phase == "contended":
                coros.append(every_second_elsewhere(pool, srv, b, span))
            log_from = len(srv.logs())
            toks, took = await timed(srv, coros, span)
            if phase == "contended":
                b_lines += request_lines(srv.logs()[log_from:], "B")
            g = got[phase]
            g["tokens"].update(toks)
            g["seconds"] += took
            g["rounds_tok_s"].append(round(sum(toks.values()) / took, 1))
            g["steps"].append(steps_between(h0, histogram(srv, STEP)))
            g["cpu"].append(use.done())
            g["preemptions"] += metric(srv, "steadyserve_preemptions_total") - preempted0
    out = {}
    for phase, g in got.items():
        out[phase] = {"A": loads[phase].summary(),
                      "output_tokens_per_s": round(sum(g["tokens"].values()) / g["seconds"], 2),
                      "output_tokens": dict(g["tokens"]), "seconds": round(g["seconds"], 1),
                      "rounds_output_tokens_per_s": g["rounds_tok_s"], "engine_steps": g["steps"], "cpu": g["cpu"]}
    out["contended"].update({"B": b.summary(), "B_server": ttft_between(b_ttft0, tenant_ttft(srv, "B")),
                             "B_split": split(b_lines), "B_slowest": slowest(b_lines),
                             "preemptions": got["contended"]["preemptions"]})
    return out["single"], out["contended"]


async def main_server(a: argparse.Namespace, keys: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    common = ("--log-format", "json", "--api-keys", str(keys), "--max-num-seqs", str(a.max_num_seqs),
              "--max-queue", str(a.max_queue))
    with ServerProcess(a.model, *common, threads=a.threads, startup_timeout=600) as srv:
        await Load(srv.http_url, "B", a.max_tokens).one()  # warm-up
        bs = a.b_seconds
        pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        pool.submit(time.sleep, 0).result()  # the process is started (and imports done) before any phase
        h0, t0, use = histogram(srv, STEP), tenant_ttft(srv, "B"), Usage(srv, pool)
        quiet = Load(srv.http_url, "B", a.max_tokens)
        log_from = len(srv.logs())
        await timed(srv, [every_second_elsewhere(pool, srv, quiet, bs)], bs)
        out["quiet"] = {"B": quiet.summary(), "B_server": ttft_between(t0, tenant_ttft(srv, "B")),
                        "B_split": split(request_lines(srv.logs()[log_from:], "B")),
                        "engine_steps": steps_between(h0, histogram(srv, STEP)), "cpu": use.done()}
        out["single"], out["contended"] = await single_and_contended(a, srv, pool)
        pool.shutdown()

        keys.write_text(keys_toml({"A": "weight = 0.001", "C": "weight = 3", "D": "weight = 1"}))
        srv.signal(signal.SIGHUP)
        await asyncio.sleep(1.0)
        c, d = Load(srv.http_url, "C", a.max_tokens), Load(srv.http_url, "D", a.max_tokens)
        until = time.monotonic() + a.shares_seconds
        toks, took = await timed(srv, [c.flood(a.flood * a.max_num_seqs, until),
                                       d.flood(a.flood * a.max_num_seqs, until)], a.shares_seconds)
        out["shares"] = {"C": c.summary(), "D": d.summary(), "output_tokens": dict(toks), "seconds": round(took, 1),
                         "ratio_C_to_D": round(toks["C"] / max(1.0, toks["D"]), 3)}
    return out


async def kv_server(a: argparse.Namespace, keys: Path) -> dict[str, Any]:
    keys.write_text(keys_toml({"A": 'priority = "batch"', "B": ""}))
    common = ("--api-keys", str(keys), "--max-num-seqs", str(a.max_num_seqs), "--max-queue", str(a.max_queue),
              "--kv-cache-memory", a.kv_full_memory)
    with ServerProcess(a.model, *common, threads=a.threads, startup_timeout=600) as srv:
        await Load(srv.http_url, "B", a.max_tokens).one()
        preempted0 = metric(srv, "steadyserve_preemptions_total")
        flood, b = Load(srv.http_url, "A", a.kv_full_tokens), Load(srv.http_url, "B", a.max_tokens)
        until = time.monotonic() + a.phase_seconds
        toks, _ = await timed(srv, [flood.flood(a.flood * a.max_num_seqs, until), b.every_second(until)],
                              a.phase_seconds)
        return {"A_batch": flood.summary(), "B_interactive": b.summary(), "output_tokens": dict(toks),
                "preemptions": metric(srv, "steadyserve_preemptions_total") - preempted0,
                "kv_cache_memory": a.kv_full_memory}


def verdicts(r: dict[str, Any]) -> dict[str, Any]:
    quiet, cont = r["quiet"]["B"], r["contended"]
    ratio = (cont["B"]["ttft_p99_s"] or 0) / max(1e-9, quiet["ttft_p99_s"] or 1e-9)
    a_refusals = {k: v for k, v in cont["A"]["error_codes"].items()}
    return {
        "B_ttft_p99_vs_quiet": round(ratio, 2), "B_ttft_within_2x": ratio <= 2.0,
        "B_429s": cont["B"]["status"].get(429, 0),
        "A_refusals_all_own_429": all(code.startswith("tenant_") for code in a_refusals)
        and set(cont["A"]["status"]) <= {200, 429},
        "throughput_vs_single": round(cont["output_tokens_per_s"] / max(1e-9, r["single"]["output_tokens_per_s"]), 3),
        "shares_ratio_within_10pct": abs(r["shares"]["ratio_C_to_D"] / 3.0 - 1.0) <= 0.10,
        "kv_full_B_never_refused": set(r["kv_full"]["B_interactive"]["status"]) <= {200},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model (default: the server's default, SmolLM2-135M-Instruct)")
    ap.add_argument("--threads", type=int, default=0, help="server threads (0: its CPU budget)")
    ap.add_argument("--max-num-seqs", type=int, default=8, help="the server's running sequences (its capacity)")
    ap.add_argument("--max-queue", type=int, default=24)
    ap.add_argument("--flood", type=int, default=5, help="A keeps this many times --max-num-seqs streams open")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--phase-seconds", type=float, default=30.0, help="the KV-full phase")
    ap.add_argument("--b-seconds", type=float, default=120.0,
                    help="the quiet, single and contended phases (each): B's requests, one a second, that its TTFT "
                    "p99 is taken over")
    ap.add_argument("--rounds", type=int, default=4, help="single and contended alternate over this many rounds")
    ap.add_argument("--shares-seconds", type=float, default=60.0)
    ap.add_argument("--kv-full-memory", default="4MiB", help="--kv-cache-memory of the KV-full server")
    ap.add_argument("--kv-full-tokens", type=int, default=96, help="max_tokens of A's batch flood there")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    load_before = os.getloadavg()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as d:
        keys = Path(d) / "keys.toml"
        keys.write_text(keys_toml({"A": "", "B": ""}))
        result = asyncio.run(main_server(a, keys))
        result["kv_full"] = asyncio.run(kv_server(a, keys))
    result["verdicts"] = verdicts(result)
    result["date"] = datetime.datetime.now().isoformat(timespec="seconds")
    result["machine"] = {"cpu": cpu_model(), "cpus": os.cpu_count(), "python": platform.python_version(),
                         "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    result["settings"] = {k: v for k, v in vars(a).items() if k != "out"}
    result["wall_seconds"] = round(time.monotonic() - t0, 1)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["verdicts"], indent=2))
    print(f"written to {a.out}")


if __name__ == "__main__":
    main()
