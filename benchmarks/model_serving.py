"""A packaged model served by steadyserve and by llama.cpp's llama-server, on the same GGUF, one at a time.

For each server: streaming /v1/completions with 64 output tokens per stream at c=1 (8 requests) and c=64
(64 requests), TTFT, peak RSS (VmHWM of it and its children), and batch invariance under load: the same
greedy request (24 tokens, token logprobs) alone, then 16 copies of it sent at once among 48 other
requests; the JSON gives how many distinct logprob vectors the 16 copies got and how many equal the one
sent alone (1 and 16 are batch-invariant). 2 compute threads each, KV budget 1 GiB, 127.0.0.1 only.

    .venv/bin/python benchmarks/model_serving.py [--model gemma3-270m] [--llama-cpp DIR]

Writes benchmarks/results/model_serving_<model>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import sys
import time
from pathlib import Path

import httpx
from gguf_serving import bench, start_llama_server
from peers import cpu_name, peak_rss_mib, warm_up

from steadyserve.models.known import resolve
from steadyserve.testing.server import ServerProcess

HERE = Path(__file__).parent
PROMPT = "The committee met on Tuesday to review the budget. After a long discussion,"


async def _completion(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> tuple[str, tuple]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1, "seed": 1}
    r = await client.post(url + "/v1/completions", json=body)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    values = lp.get("token_logprobs") or [x["logprob"] for x in lp.get("content", [])]
    return choice["text"], tuple(values)


async def _invariance(url: str) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        alone = await _completion(client, url, PROMPT, 24)
        others = [f"Story {i}: in a small village near the river" + " and" * (i % 9) for i in range(48)]
        results = await asyncio.gather(*[_completion(client, url, PROMPT, 24) for _ in range(16)],
                                       *[_completion(client, url, p, 48) for p in others])
    copies = results[:16]
    drift = max((abs(a - b) for _, v in copies for a, b in zip(v, alone[1])), default=0.0)
    return {"distinct_logprob_vectors": len({v for _, v in copies}), "distinct_texts": len({t for t, _ in copies}),
            "equal_to_alone": sum(v == alone[1] for _, v in copies), "max_drift_nats": drift, "copies": 16,
            "others": 48}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma3-270m", help="a packaged model's name (steadyserve's --model)")
    p.add_argument("--llama-cpp", type=Path, default=Path(os.environ.get("LLAMA_CPP_BIN", "/tmp/llama/bin")),
                   help="llama.cpp's build/bin directory (benchmarks/build_llama_cpp.sh)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    gguf = str(resolve(a.model))
    res: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"), "cpu": cpu_name(),
                 "cpus": os.cpu_count(), "model": a.model, "gguf": Path(gguf).name,
                 "gguf_bytes": Path(gguf).stat().st_size, "threads": a.threads, "output_tokens": 64, "kv_cache": "1GiB",
                 "command": " ".join([".venv/bin/python benchmarks/model_serving.py", *sys.argv[1:]]),
                 "servers": {}, "levels": {}, "peak_rss_mib": {}, "invariance": {}}
    for name in ("steadyserve", "llama-server"):
        if name == "llama-server":
            srv = start_llama_server(a.llama_cpp, gguf, a.threads)
            url, pid, stop = srv.url, srv.pid, srv.stop
            res["servers"][name] = srv.settings
        else:
            sp = ServerProcess(a.model, "--kv-cache-memory", "1GiB", "--max-num-seqs", "64", "--max-queue", "512",
                               threads=a.threads)
            url, pid, stop = sp.http_url, sp.proc.pid, sp.stop
            res["servers"][name] = {"command": " ".join(sp.argv)}
        try:
            print(f"{name}: warming up", file=sys.stderr)
            warm_up(url, None)
            for c, n in ((1, 8), (64, 64)):
                r = bench(url, c, n, 64, None, True)
                res["levels"].setdefault(str(c), {})[name] = r
                print(f"  c={c}: {r['output_tokens_per_s']:.1f} tok/s, TTFT p50 {r['ttft_s']['p50']:.3f} s", file=sys.stderr)
            res["invariance"][name] = asyncio.run(_invariance(url))
            print(f"  invariance: {res['invariance'][name]}", file=sys.stderr)
            res["peak_rss_mib"][name] = peak_rss_mib(pid)["peak_rss_mib"]
        finally:
            stop()
        time.sleep(2)
    tps = {c: {n: v["output_tokens_per_s"] for n, v in lv.items()} for c, lv in res["levels"].items()}
    res["ratios"] = {f"c{c} steadyserve / llama-server": round(v["steadyserve"] / v["llama-server"], 3)
                     for c, v in tps.items()}
    out = a.out or HERE / "results" / f"model_serving_{a.model}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: res[k] for k in ("ratios", "peak_rss_mib", "invariance")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
