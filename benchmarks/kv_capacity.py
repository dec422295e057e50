"""Concurrency at a fixed KV memory budget: steadyserve's KV formats against llama-server (issue 44: "Tokens per
GiB: at least 2x today's with f16 and 3.5x with q8_0 ... concurrency admitted at a fixed budget on the 1.7B
shape, against llama-server with the same memory").

For one GGUF (by default the SmolLM2-1.7B shape, Q4_K_M, random weights: benchmarks/make_random_gguf.py) and
one KV budget (default 1GiB), streams of P prompt + G output tokens (default 512 + 128; random token ids, a
different prompt per stream so no prefix is shared; ignore_eos so each runs its G tokens):
- steadyserve, per --kv-cache-dtype (fp32, f16, bf16, q8_0), with --kv-cache-memory BUDGET and --speculation
  off (draft tokens would take KV beyond P+G): the server's own capacity (its /metrics
  steadyserve_kv_cache_capacity_tokens, _blocks, _bytes); N = the streams whose blocks fit
  (blocks // ceil((P+G)/block_size)); then N streams sent at once, checked to all run at once (peak of
  steadyserve_requests_running sampled while they run) with no preemption (steadyserve_preemptions_total),
  and N+1 streams at once, to show the bound is real (a preemption, or one waiting);
- llama-server (--llama-cpp DIR, default /tmp/llama/bin, skipped if absent), per -ctk/-ctv f16 and q8_0 (-fa on,
  which its quantized V cache needs): its KV bytes per token from the model shape (2 x layers x kv heads x
  head dim x 2 bytes for f16, x 34/32 bytes for q8_0), N = slots of P+G tokens whose KV fits the budget,
  started with -np N -c N*(P+G) --kv-unified (one pool for all slots, as steadyserve's); N counts llama.cpp's rounding of the context up
  to 256 cells; the size it logs (llama_kv_cache: size = ... MiB, with -v) is recorded
  and checked against the budget, and N streams sent at once are checked to all run at once (the peak of
  its /metrics llamacpp:requests_processing).

Writes benchmarks/results/kv_capacity.json: tokens per GiB per format, ratios to steadyserve's fp32 and to
llama-server's same format, and the concurrency measured. Capacity numbers do not depend on machine load;
timings (also recorded) do.

    .venv/bin/python benchmarks/kv_capacity.py [--gguf PATH] [--kv-budget 1GiB] [--prompt 512] [--output-tokens 128]
        [--formats fp32,f16,bf16,q8_0] [--llama-cpp /tmp/llama/bin] [--no-over] [--capacity-only]
    # a quick check on the default small model:
    .venv/bin/python benchmarks/kv_capacity.py --gguf default --kv-budget 8MiB --prompt 48 --output-tokens 16
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from peers import Peer, cpu_name, free_port, thread_env

from steadyserve.config import parse_size
from steadyserve.models.loader import convert_gguf, default_model_path
from steadyserve.testing.server import ServerProcess

HERE = Path(__file__).parent
FORMATS = ("fp32", "f16", "bf16", "q8_0")
LLAMA_FORMATS = {"f16": 2.0, "q8_0": 34 / 32}  # bytes per stored value: f16; q8_0 = 32 int8 + an f16 scale
DEFAULT_GGUF = Path.home() / ".cache/steadyserve/bench-models/smollm2-1.7b-shape-Q4_K_M.gguf"
GIB = 1024**3


def model_shape(gguf: Path) -> dict:
    """Layers, KV heads, head dim and vocabulary from the GGUF's converted config (no weights)."""
    cfg = json.loads((convert_gguf(gguf, with_weights=False)[0] / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    return {"layers": cfg["num_hidden_layers"], "kv_heads": cfg.get("num_key_value_heads", heads),
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads, "vocab": cfg["vocab_size"]}


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


class Peak:
    """Samples `read()` every 0.1 s in a thread until stopped; keeps the maximum."""

    def __init__(self, read) -> None:
        self.read, self.peak, self._stop = read, 0.0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.read())
            except (OSError, httpx.HTTPError):
                pass
            self._stop.wait(0.1)

    def stop(self) -> float:
        self._stop.set()
        self._t.join()
        return self.peak


def send_all(url: str, bodies: list[dict], timeout: float) -> list[dict]:
    """POST every body at once (one thread each); returns each response's JSON (or its error)."""
    def one(body: dict) -> dict:
        try:
            r = httpx.post(url, json=body, timeout=timeout)
            return r.json() if r.status_code == 200 else {"error": f"{r.status_code} {r.text[:200]}"}
        except httpx.HTTPError as e:
            return {"error": repr(e)}

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(one, bodies))


def steadyserve_run(s: ServerProcess, n: int, a, shape: dict, seed: int) -> dict:
    preempted0 = s.metric("steadyserve_preemptions_total")
    peak = Peak(lambda: s.metric("steadyserve_requests_running"))
    t0 = time.monotonic()
    bodies = [{"model": "m", "prompt": p, "max_tokens": a.output_tokens, "ignore_eos": True, "temperature": 0}
              for p in prompts(n, a.prompt, shape["vocab"], seed)]
    res = send_all(s.http_url + "/v1/completions", bodies, a.timeout)
    running = peak.stop()
    done = [r for r in res if "error" not in r]
    return {"streams": n, "completed": len(done), "errors": [r["error"] for r in res if "error" in r][:3],
            "output_tokens": sum(r["usage"]["completion_tokens"] for r in done),
            "peak_running": int(running), "preemptions": int(s.metric("steadyserve_preemptions_total") - preempted0),
            "seconds": round(time.monotonic() - t0, 1)}


def steadyserve_format(gguf: str, fmt: str, a, shape: dict) -> dict:
    with ServerProcess(gguf, "--kv-cache-dtype", fmt, "--kv-cache-memory", str(a.budget), "--speculation", "off",
                       "--grpc-port", "-1", "--served-model-name", "m", "--max-num-seqs", str(a.max_num_seqs),
                       threads=a.threads, startup_timeout=1200) as s:
        cap = s.metric("steadyserve_kv_cache_capacity_tokens", kv_dtype=fmt)
        blocks = s.metric("steadyserve_kv_cache_blocks", kv_dtype=fmt)
        nbytes = s.metric("steadyserve_kv_cache_bytes", kv_dtype=fmt)
        block_size = int(cap // blocks)
        per_stream = math.ceil((a.prompt + a.output_tokens) / block_size)
        n = min(int(blocks) // per_stream, a.max_num_seqs)
        row = {"capacity_tokens": int(cap), "blocks": int(blocks), "block_size": block_size, "kv_bytes": int(nbytes),
               "tokens_per_gib": cap / a.budget * GIB, "bytes_per_token": nbytes / cap,
               "blocks_per_stream": per_stream, "predicted_streams": n}
        print(f"steadyserve {fmt}: {int(cap)} tokens in {nbytes / 2**20:.1f} MiB, {n} streams predicted", flush=True)
        if a.capacity_only:
            return row
        row["at_n"] = steadyserve_run(s, n, a, shape, seed=1)
        ok = (row["at_n"]["completed"] == n and row["at_n"]["peak_running"] == n and row["at_n"]["preemptions"] == 0)
        row["all_n_ran_at_once_without_preemption"] = ok
        if not a.no_over and n < a.max_num_seqs:
            row["at_n_plus_1"] = steadyserve_run(s, n + 1, a, shape, seed=2)
        print(f"  {row['at_n']}" + (f"\n  n+1: {row['at_n_plus_1']}" if "at_n_plus_1" in row else ""), flush=True)
    return row


def llama_format(bin_dir: Path, gguf: str, cache: str, a, shape: dict) -> dict:
    per_token = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * LLAMA_FORMATS[cache]
    stream = a.prompt + a.output_tokens
    # llama.cpp rounds its context up to a multiple of 256 cells (640 -> 768): N is the most slots whose
    # padded cache still fits the budget.
    n = 0
    while n < a.max_num_seqs and -(-(n + 1) * stream // 256) * 256 * per_token <= a.budget:
        n += 1
    port = free_port()
    argv = [str(bin_dir / "llama-server"), "-m", gguf, "-np", str(n), "-c", str(n * stream), "-cb", "-t",
            str(a.threads), "-ctk", cache, "-ctv", cache, "-fa", "on", "--kv-unified", "--metrics", "--no-warmup",
            "-v",  # -v: it logs its KV cache size only at this verbosity
            "--host", "127.0.0.1", "--port", str(port)]
    row = {"bytes_per_token": per_token, "tokens_per_gib": GIB / per_token, "predicted_streams": n,
           "slots_unpadded": int(a.budget // (per_token * stream)), "argv": argv[1:]}
    peer = Peer(f"llama-server {cache}", argv, thread_env(a.threads), "/health", {"port": port})
    try:
        logged = re.findall(r"llama_kv_cache:\s+size\s*=\s*([\d.]+) MiB \(\s*(\d+) cells", peer.log_tail(10**6))
        if logged:
            mib, cells = float(logged[-1][0]), int(logged[-1][1])
            row.update(logged_kv_mib=mib, logged_cells=cells, logged_bytes_per_token=mib * 2**20 / cells,
                       logged_fits_budget=mib * 2**20 <= a.budget)
        url = f"http://127.0.0.1:{port}"
        if a.capacity_only:
            return row

        def processing() -> float:
            m = re.search(r"^llamacpp:requests_processing (\S+)", httpx.get(url + "/metrics", timeout=5).text, re.M)
            return float(m.group(1)) if m else 0.0

        peak = Peak(processing)
        t0 = time.monotonic()
        bodies = [{"prompt": p, "n_predict": a.output_tokens, "ignore_eos": True, "temperature": 0,
                   "cache_prompt": False} for p in prompts(n, a.prompt, shape["vocab"], seed=1)]
        res = send_all(url + "/completion", bodies, a.timeout)
        done = [r for r in res if "error" not in r]
        row["at_n"] = {"streams": n, "completed": len(done), "errors": [r["error"] for r in res if "error" in r][:3],
                       "output_tokens": sum(r.get("tokens_predicted", 0) for r in done),
                       "peak_processing": int(peak.stop()), "seconds": round(time.monotonic() - t0, 1)}
        row["all_n_ran_at_once"] = row["at_n"]["completed"] == n and row["at_n"]["peak_processing"] == n
    finally:
        peer.stop()
        print(f"llama-server {cache}: {row}", flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gguf", default=str(DEFAULT_GGUF), help="a GGUF file, or `default` for the packaged SmolLM2-135M")
    p.add_argument("--kv-budget", default="1GiB")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--llama-cpp", default="/tmp/llama/bin", help="directory holding llama-server; '' to skip")
    p.add_argument("--max-num-seqs", type=int, default=256, help="both servers' cap on concurrent streams")
    p.add_argument("--no-over", action="store_true", help="skip the N+1 streams run on steadyserve")
    p.add_argument("--capacity-only", action="store_true",
                   help="start each server and read its capacity, send no streams (capacity needs no quiet machine)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    p.add_argument("--output", default=str(HERE / "results" / "kv_capacity.json"))
    a = p.parse_args()
    a.budget = parse_size(a.kv_budget, "--kv-budget")
    gguf = default_model_path() if a.gguf == "default" else a.gguf
    if not Path(gguf).exists():
        if Path(gguf) != DEFAULT_GGUF:
            sys.exit(f"{gguf}: no such file")
        subprocess.run([sys.executable, str(HERE / "make_random_gguf.py")], check=True)
    shape = model_shape(Path(gguf))
    out: dict = {"benchmark": "kv_capacity", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                 "cpu": cpu_name(), "command": "python " + " ".join(sys.argv), "gguf": Path(gguf).name,
                 "shape": shape, "kv_budget_bytes": a.budget, "prompt_tokens": a.prompt,
                 "output_tokens": a.output_tokens, "steadyserve": {}, "llama_server": {}}
    for fmt in a.formats.split(","):
        out["steadyserve"][fmt] = steadyserve_format(gguf, fmt, a, shape)
    bin_dir = Path(a.llama_cpp) if a.llama_cpp else None
    if bin_dir and (bin_dir / "llama-server").exists():
        for cache in LLAMA_FORMATS:
            out["llama_server"][cache] = llama_format(bin_dir, gguf, cache, a, shape)
    ss, ll = out["steadyserve"], out["llama_server"]
    for fmt, row in ss.items():
        if "fp32" in ss:
            row["tokens_per_gib_vs_fp32"] = row["tokens_per_gib"] / ss["fp32"]["tokens_per_gib"]
            row["streams_vs_fp32"] = row["predicted_streams"] / max(ss["fp32"]["predicted_streams"], 1)
        if fmt in ll:
            row["tokens_per_gib_vs_llama_server"] = row["tokens_per_gib"] / ll[fmt]["tokens_per_gib"]
            row["streams_vs_llama_server"] = row["predicted_streams"] / max(ll[fmt]["predicted_streams"], 1)
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(out, indent=1) + "\n")
    print(f"\n{Path(gguf).name}, KV budget {a.budget / 2**20:.0f} MiB, streams of {a.prompt}+{a.output_tokens} tokens")
    print("| server | KV | tokens/GiB | vs fp32 | vs llama-server | streams | all ran at once |")
    print("|---|---|---|---|---|---|---|")
    for fmt, r in ss.items():
        print(f"| steadyserve | {fmt} | {r['tokens_per_gib']:.0f} | {r.get('tokens_per_gib_vs_fp32', 0):.2f} | "
              f"{r.get('tokens_per_gib_vs_llama_server', float('nan')):.2f} | {r['predicted_streams']} | "
              f"{r.get('all_n_ran_at_once_without_preemption', 'not run')} |")
    for cache, r in ll.items():
        print(f"| llama-server | {cache} | {r['tokens_per_gib']:.0f} | | | {r['predicted_streams']} | "
              f"{r.get('all_n_ran_at_once', 'not run')} |")


if __name__ == "__main__":
    main()
