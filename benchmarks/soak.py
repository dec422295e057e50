"""Memory soak (`make soak`): mixed traffic against a real server; RSS growth after warm-up must stay under 5%.

Starts `steadyserve serve` on 127.0.0.1 with the tiny test model (built now; override with --model, e.g. the
default SmolLM2 with --model "" ) and a 64 MiB KV cache, then runs for --minutes: SSE streams (some read
slowly, some hang up mid-stream), non-streaming completions and chat, WebSocket streams, gRPC Score and
Generate, and a few requests that are refused (bad input). RSS is sampled every second from /proc; the
result is written to benchmarks/results/soak.json. Exit status 1 if growth >= 5% or any request saw a 5xx.

    .venv/bin/python benchmarks/soak.py --minutes 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import grpc
import httpx
from websockets.asyncio.client import connect as ws_connect

from steadyserve.client import AsyncClient
from steadyserve.testing import build_tiny_model
from steadyserve.testing.server import ServerProcess
from steadyserve.tools.sse_client import sse_post

RESULTS = Path(__file__).parent / "results" / "soak.json"


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


async def traffic(srv: ServerProcess, until: float, counts: dict[str, int], rng: random.Random) -> None:
    url = srv.http_url
    async with httpx.AsyncClient(base_url=url, timeout=120) as c, AsyncClient(srv.grpc_addr, timeout=120,
                                                                               retries=False) as g:
        while time.monotonic() < until:
            kind = rng.choice(["sse", "sse_slow", "sse_disconnect", "http", "chat", "ws", "grpc_score",
                               "grpc_generate", "bad"])
            n = rng.randint(4, 48)
            try:
                if kind.startswith("sse"):
                    body = {"prompt": f"soak {rng.random()}", "max_tokens": n, "stream": True, "logprobs": 2}
                    r = await sse_post(url + "/v1/completions", body,
                                       read_rate=3000 if kind == "sse_slow" else None,
                                       disconnect_after_events=2 if kind == "sse_disconnect" else None)
                    status = r.status
                    if kind != "sse_disconnect" and r.status == 200 and r.truncated:
                        counts["truncated"] = counts.get("truncated", 0) + 1
                elif kind == "http":
                    status = (await c.post("/v1/completions", json={"prompt": "soak", "max_tokens": n,
                                                                    "logprobs": 5, "echo": True})).status_code
                elif kind == "chat":
                    status = (await c.post("/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "soak"}], "max_tokens": n})).status_code
                elif kind == "ws":
                    async with ws_connect(f"ws://127.0.0.1:{srv.http_port}/v1/stream") as ws:
                        await ws.send(json.dumps({"prompt": "soak", "max_tokens": n}))
                        async for _ in ws:
                            pass
                    status = 200
                elif kind == "grpc_score":
                    await g.score("soak " * rng.randint(1, 50), top_logprobs=5)
                    status = 200
                elif kind == "grpc_generate":
                    async for _ in g.generate("soak", max_tokens=n):
                        pass
                    status = 200
                else:
                    status = (await c.post("/v1/completions", json={"prompt": "x", "temperature": -1})).status_code
            except grpc.aio.AioRpcError as e:
                status = 429 if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else 500
            counts[f"{kind}:{status}"] = counts.get(f"{kind}:{status}", 0) + 1


async def run(srv: ServerProcess, minutes: float, concurrency: int, warmup_s: float) -> dict:
    rng = random.Random(0)
    counts: dict[str, int] = {}
    samples: list[tuple[float, int]] = []
    t0 = time.monotonic()
    until = t0 + minutes * 60

    async def sampler() -> None:
        while time.monotonic() < until:
            samples.append((round(time.monotonic() - t0, 1), rss(srv.proc.pid)))
            await asyncio.sleep(1.0)

    await asyncio.gather(sampler(), *(traffic(srv, until, counts, random.Random(rng.random()))
                                      for _ in range(concurrency)))
    warm = [v for t, v in samples if t >= warmup_s]
    base = warm[0] if warm else samples[0][1]
    # Growth: the mean of the last 10% of samples against the first sample after warm-up.
    tail = warm[-max(1, len(warm) // 10):] if warm else [samples[-1][1]]
    growth = (sum(tail) / len(tail) - base) / base
    return {"minutes": minutes, "concurrency": concurrency, "warmup_s": warmup_s, "requests": sum(
        v for k, v in counts.items() if k != "truncated"), "counts": dict(sorted(counts.items())),
        "rss_after_warmup_bytes": base, "rss_end_bytes": samples[-1][1], "rss_max_bytes": max(v for _, v in samples),
        "rss_growth": round(growth, 4), "rss_samples": samples,
        "five_xx": sum(v for k, v in counts.items() if k.endswith(":500") or k.endswith(":503")),
        "truncated": counts.get("truncated", 0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--warmup", type=float, default=None, help="seconds (default: 15%% of the run, at least 30)")
    ap.add_argument("--model", default=None, help="model path (default: the tiny test model, built now)")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args()
    model = a.model if a.model is not None else str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny",
                                                                      max_position_embeddings=4096))
    warmup = a.warmup if a.warmup is not None else max(30.0, a.minutes * 60 * 0.15)
    with ServerProcess(model, "--kv-cache-memory", "64MiB", "--max-num-seqs", "16", "--max-queue", "32",
                       "--stall-timeout", "10", threads=1) as srv:
        result = asyncio.run(run(srv, a.minutes, a.concurrency, warmup))
        result["model"] = model or "SmolLM2-135M-Instruct (default)"
        result["server_alive"] = srv.proc.poll() is None
    result["passed"] = result["rss_growth"] < 0.05 and result["five_xx"] == 0 and result["truncated"] == 0
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"soak: {a.minutes} min, {result['requests']} requests {result['counts']}; RSS after warm-up "
          f"{result['rss_after_warmup_bytes'] / 2**20:.0f} MiB -> end {result['rss_end_bytes'] / 2**20:.0f} MiB "
          f"(max {result['rss_max_bytes'] / 2**20:.0f}); growth {result['rss_growth'] * 100:.2f}% (limit 5%); "
          f"5xx {result['five_xx']}; truncated {result['truncated']}; {'PASS' if result['passed'] else 'FAIL'} "
          f"-> {out}")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
