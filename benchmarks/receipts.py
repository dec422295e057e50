"""Receipts' overhead: the same requests with and without `"receipt": true`, at c=1 and c=64, over HTTP.

One server (the default model unless --model), closed loop: `--requests` completions per setting, each
`--max-tokens` tokens with `--logprobs` alternatives (sampled, unseeded: the receipt records a drawn seed),
alternated round by round (off, on, off, on ...) so that machine drift cannot pass for a cost. Reports per
concurrency: request latency p50/p99, output tokens/s, response bytes per request, and the on/off ratios.
Also the cost of building one receipt in-process (receipts/format.py) for the same sizes.

    .venv/bin/python benchmarks/receipts.py [--model PATH] [--concurrency 1,64] [--requests 256] [--rounds 2]

Writes JSON to --output (default benchmarks/results/receipts.json) and prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).parent


async def closed_loop(url: str, concurrency: int, n: int, body: dict) -> dict:
    """n requests, `concurrency` at a time; latency percentiles, output tok/s, bytes per response."""
    lat: list[float] = []
    tokens = nbytes = 0
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=concurrency + 4)) as c:
        async def one(i: int) -> None:
            nonlocal tokens, nbytes
            async with sem:
                t0 = time.perf_counter()
                r = await c.post("/v1/completions", json={**body, "prompt": f"{body['prompt']} {i}"})
                lat.append(time.perf_counter() - t0)
                r.raise_for_status()
                data = r.json()
                tokens += data["usage"]["completion_tokens"]
                nbytes += len(r.content)
                assert ("receipt" in data["choices"][0]) == bool(body.get("receipt"))

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        wall = time.perf_counter() - t0
    lat.sort()
    return {"requests": n, "seconds": wall, "tok_s": tokens / wall, "p50_s": statistics.median(lat),
            "p99_s": lat[min(len(lat) - 1, int(len(lat) * 0.99))], "bytes_per_response": nbytes / n}


def build_cost(max_tokens: int, logprobs: int, repeats: int = 200) -> dict:
    """Microseconds to build one receipt of this size from host values (what the server adds per response)."""
    from steadyserve.engine.sequence import SamplingParams, TokenLogprob
    from steadyserve.receipts.format import Identity, make_receipt

    ident = Identity("m", "0" * 64, "fp", "portable", "p000000", "float32", "cpu", "nat1", True)
    lps = [TokenLogprob(i, -1.5 - i * 1e-3, [(j, -2.0 - j * 1e-3) for j in range(logprobs)])
           for i in range(max_tokens)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.8, logprobs=logprobs)
    t0 = time.perf_counter()
    for _ in range(repeats):
        make_receipt(ident, "req", 0, list(range(32)), params, 123, list(range(max_tokens)), "length", None, lps)
    return {"max_tokens": max_tokens, "logprobs": logprobs, "us_per_receipt": (time.perf_counter() - t0) / repeats * 1e6}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="model to serve (default: the packaged SmolLM2)")
    ap.add_argument("--concurrency", default="1,64", help="comma-separated concurrencies")
    ap.add_argument("--requests", type=int, default=256, help="requests per setting and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--logprobs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="server --threads (0: its CPU budget)")
    ap.add_argument("--output", default=str(HERE / "results" / "receipts.json"))
    a = ap.parse_args()
    from steadyserve.testing.server import ServerProcess

    concurrencies = [int(c) for c in a.concurrency.split(",")]
    body = {"prompt": "Receipts cost nothing when not asked for, and little when", "max_tokens": a.max_tokens,
            "temperature": 0.8, "logprobs": a.logprobs, "ignore_eos": True}
    args = ["--max-num-seqs", str(max(concurrencies)), "--max-queue", str(max(concurrencies) * 4)]
    results: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                     "model": a.model or "SmolLM2-135M-Instruct.Q4_1 (default)", "max_tokens": a.max_tokens,
                     "logprobs": a.logprobs, "rounds": a.rounds, "concurrency": {}}
    with ServerProcess(a.model, *args, threads=a.threads, startup_timeout=900) as srv:
        asyncio.run(closed_loop(srv.http_url, 1, 2, body))  # warm-up
        for c in concurrencies:
            runs: dict[str, list[dict]] = {"off": [], "on": []}
            for _ in range(a.rounds):
                for setting in ("off", "on"):
                    b = {**body, "receipt": True} if setting == "on" else body
                    runs[setting].append(asyncio.run(closed_loop(srv.http_url, c, a.requests, b)))
            med = {s: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for s, rs in runs.items()}
            results["concurrency"][str(c)] = {
                **med, "ratio_tok_s_on_off": med["on"]["tok_s"] / med["off"]["tok_s"],
                "ratio_p50_on_off": med["on"]["p50_s"] / med["off"]["p50_s"]}
    results["build_cost"] = build_cost(a.max_tokens, a.logprobs)
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
