"""steadyserve vs the incident reports' design, side by side in one run.

Starts steadyserve (SmolLM2-135M, float32, batch-invariant), steadyserve with
--no-batch-invariant, and benchmarks/baseline_server.py (transformers
generate() behind a global lock) on the same model and machine, then measures:
streaming throughput and TTFT at concurrency 1, 16, 64; scoring requests/s at
concurrency 64; and drift (distinct logprob vectors from `steadyserve
validate`). Writes benchmarks/results/serving.json and a markdown table.

    .venv/bin/python benchmarks/serving.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

from steadyserve.models.loader import convert_gguf, default_model_path
from steadyserve.testing.server import ServerProcess
from steadyserve.tools.bench import Bench
from steadyserve.tools.validate import run_validate

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_baseline(model_dir: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(HERE / "baseline_server.py"), "--model", model_dir, "--port",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(url + "/docs", timeout=1)
            return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("baseline server did not start")


def bench(url: str, *, mode: str, concurrency: int, n: int, output_tokens: int, prompt_words: str) -> dict:
    a = SimpleNamespace(url=url, grpc=None, mode=mode, transport="sse", concurrency=concurrency, n=n, rate=None,
                        duration=0, prompt_words=prompt_words, output_tokens=str(output_tokens), ignore_eos=True,
                        slow_readers=0.0, slow_rate=2000.0, disconnect=0.0, seed=1, api_key="", json=True,
                        output=None, plot=None)
    return asyncio.run(Bench(a).run())


def validate(url: str, n: int, background: float = 0.5) -> dict:
    return asyncio.run(run_validate(url, None, n, min(n, 64), background,
                                    "Batch invariance means the same request gets the same numbers.", 16, "", False))


def distinct(rep: dict) -> int:
    return max((g["distinct_vectors"] for k in rep["kinds"].values() for g in k["fingerprints"].values()), default=0)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="fewer requests per level (a smoke run)")
    p.add_argument("--output-tokens", type=int, default=32)
    a = p.parse_args()
    levels = [1, 16, 64]
    model_dir, _ = convert_gguf(Path(default_model_path()))
    results: dict = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
                     "model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to float32)", "levels": {}}
    servers = {}
    common = ("--kv-cache-memory", "1GiB", "--max-num-seqs", "64", "--max-queue", "512")
    servers["steadyserve"] = ServerProcess("", *common)
    servers["steadyserve --no-batch-invariant"] = ServerProcess("", *common, "--no-batch-invariant")
    base_proc, base_url = start_baseline(str(model_dir))
    urls = {"steadyserve": servers["steadyserve"].http_url,
            "steadyserve --no-batch-invariant": servers["steadyserve --no-batch-invariant"].http_url,
            "baseline": base_url}
    try:
        for c in levels:
            n = c if a.quick else max(2 * c, 8)
            for name in ("steadyserve", "baseline"):
                print(f"streaming c={c} n={n} {name}", file=sys.stderr)
                r = results["levels"].setdefault(str(c), {})[name] = bench(
                    urls[name], mode="generate", concurrency=c, n=n, output_tokens=a.output_tokens,
                    prompt_words="20-40")
                print(f"  {r['output_tokens_per_s']:.1f} tok/s, ttft p50 {r['ttft_s']['p50']}, "
                      f"p99 {r['ttft_s']['p99']}, truncated {r['truncated_streams']}", file=sys.stderr)
        score_n = 64 if a.quick else 256
        results["scoring"] = {}
        for name in ("steadyserve", "baseline"):
            print(f"scoring c=64 n={score_n} {name}", file=sys.stderr)
            results["scoring"][name] = bench(urls[name], mode="score", concurrency=64, n=score_n, output_tokens=0,
                                             prompt_words="20-40")
        results["drift"] = {}
        for name, url in urls.items():
            print(f"validate {name}", file=sys.stderr)
            # The baseline serializes every request behind its lock: background traffic cannot share
            # a batch with its probes, so it would only make the run longer.
            rep = validate(url, (32 if name == "baseline" else 64) if a.quick else 200,
                           0.0 if name == "baseline" else 0.5)
            print(f"  distinct vectors {distinct(rep)}", file=sys.stderr)
            results["drift"][name] = {"distinct_vectors": distinct(rep), "report": rep}
    finally:
        for s in servers.values():
            s.stop()
        base_proc.terminate()
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "serving.json").write_text(json.dumps(results, indent=2))
    table = markdown(results, a)
    print(table)
    (out / "serving.md").write_text(table)
    return 0


def markdown(r: dict, a: argparse.Namespace) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    lines = [f"Serving benchmark, {r['date']}, {r['machine']}, {r['model']}, {a.output_tokens} output tokens, "
             f"command: `.venv/bin/python benchmarks/serving.py{' --quick' if a.quick else ''}`", "",
             "| concurrency | steadyserve tok/s | baseline tok/s | ratio | steadyserve TTFT p50 / p99 ms | "
             "baseline TTFT p50 / p99 ms |", "|---|---|---|---|---|---|"]
    for c, d in r["levels"].items():
        s, b = d["steadyserve"], d["baseline"]
        ratio = s["output_tokens_per_s"] / b["output_tokens_per_s"] if b["output_tokens_per_s"] else float("inf")
        lines.append(f"| {c} | {s['output_tokens_per_s']:.1f} | {b['output_tokens_per_s']:.1f} | {ratio:.1f}x | "
                     f"{ms(s['ttft_s']['p50'])} / {ms(s['ttft_s']['p99'])} | "
                     f"{ms(b['ttft_s']['p50'])} / {ms(b['ttft_s']['p99'])} |")
    s, b = r["scoring"]["steadyserve"], r["scoring"]["baseline"]
    lines += ["", f"Scoring at concurrency 64: steadyserve {s['requests_per_s']:.1f} req/s, baseline "
              f"{b['requests_per_s']:.1f} req/s ({s['requests_per_s'] / max(b['requests_per_s'], 1e-9):.1f}x).", "",
              "| server | distinct logprob vectors per probe kind (validate) |", "|---|---|"]
    for name, d in r["drift"].items():
        lines.append(f"| {name} | {d['distinct_vectors']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
