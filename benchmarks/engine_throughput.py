"""Engine throughput against the machine's own roofline, batch-invariant vs not.

In one run, with SmolLM2-135M, float32, 2 threads:
  * roofline: peak fp32 matmul FLOP/s (large torch.mm) / (2 x parameters) = tokens/s
    a perfectly compute-bound forward pass could reach;
  * decode throughput (generated tokens/s) at concurrency 1, 8, 32, 64, 128 with
    128-token prompts and 128-token outputs, both end-to-end (prefill included)
    and over decode-only steps, each as a fraction of the roofline;
  * batch-invariant vs --no-batch-invariant, side by side;
  * peak RSS vs model + KV budget + 500 MiB.

    .venv/bin/python benchmarks/engine_throughput.py [--quick] [--levels 1,8,64]
Writes benchmarks/results/engine_throughput.json and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

from steadyserve.config import EngineConfig
from steadyserve.engine.engine import LLMEngine
from steadyserve.engine.selftest import run_selftest
from steadyserve.engine.sequence import Request, SamplingParams
from steadyserve.models import load_model


def peak_matmul_flops(n: int = 2048, reps: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t)
    return 2 * n ** 3 / min(times)


def run_level(engine: LLMEngine, concurrency: int, prompt_len: int, output_len: int, seed: int) -> dict:
    rng = random.Random(seed)
    vocab = engine.loaded.args.vocab_size
    for i in range(concurrency):
        engine.add_request(Request(f"c{concurrency}-{i}", [rng.randrange(vocab) for _ in range(prompt_len)],
                                   SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)))
    generated = 0
    decode_tokens = 0
    decode_time = 0.0
    t0 = time.perf_counter()
    while engine.has_work():
        outs, st = engine.step()
        generated += st.num_generated
        if st.num_tokens == st.num_seqs:  # a pure decode step: one token per sequence
            decode_tokens += st.num_generated
            decode_time += st.duration
    wall = time.perf_counter() - t0
    return {"concurrency": concurrency, "generated_tokens": generated, "wall_s": wall,
            "e2e_tokens_per_s": generated / wall, "decode_tokens_per_s": decode_tokens / decode_time if decode_time else None}


def _save(results: dict) -> None:
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "engine_throughput.json").write_text(json.dumps(results, indent=2))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--levels", default="1,8,32,64,128")
    p.add_argument("--plain-levels", default=None, help="levels for --no-batch-invariant (default: --levels)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="32-token outputs (a smoke run)")
    a = p.parse_args()
    if a.quick:
        a.output_len = 32
    levels = [int(x) for x in a.levels.split(",")]
    torch.set_num_threads(a.threads)
    peak = peak_matmul_flops()
    kv_budget = 2 * 1024 ** 3
    results: dict = {"date": datetime.date.today().isoformat(), "threads": a.threads, "prompt_len": a.prompt_len,
                     "output_len": a.output_len, "peak_matmul_gflops": peak / 1e9, "runs": {}}
    for bi in (True, False):
        lm = load_model("", batch_invariant=bi)
        params = lm.args.num_params
        roofline = peak / (2 * params)
        results["params"] = params
        results["roofline_tokens_per_s"] = roofline
        model_bytes = params * 4
        cfg = EngineConfig(kv_cache_memory=kv_budget, threads=a.threads, max_num_seqs=max(levels),
                           max_num_batched_tokens=2048, batch_invariant=bi, max_queue=max(levels))
        engine = LLMEngine(lm, cfg)
        st = run_selftest(engine)
        name = "batch_invariant" if bi else "plain"
        runs = []
        for c in (levels if bi or not a.plain_levels else [int(x) for x in a.plain_levels.split(",")]):
            r = run_level(engine, c, a.prompt_len, a.output_len, seed=c)
            r["e2e_fraction_of_roofline"] = r["e2e_tokens_per_s"] / roofline
            if r["decode_tokens_per_s"]:
                r["decode_fraction_of_roofline"] = r["decode_tokens_per_s"] / roofline
            print(f"{name:16s} c={c:4d} e2e {r['e2e_tokens_per_s']:7.1f} tok/s "
                  f"decode {r['decode_tokens_per_s'] or 0:7.1f} tok/s "
                  f"({100 * r.get('decode_fraction_of_roofline', 0):.0f}% of roofline)", file=sys.stderr)
            runs.append(r)
            results["runs"][name] = {"selftest": st.detail, "levels": runs, "model_bytes": model_bytes}
            _save(results)  # a long run keeps what it measured so far
        del engine, lm
        gc.collect()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    results["peak_rss_bytes"] = rss
    results["rss_bound_bytes"] = results["params"] * 4 + kv_budget + 500 * 1024 ** 2
    bi_runs = {r["concurrency"]: r for r in results["runs"]["batch_invariant"]["levels"]}
    plain_runs = {r["concurrency"]: r for r in results["runs"]["plain"]["levels"]}
    results["invariance_cost"] = {c: 1 - bi_runs[c]["e2e_tokens_per_s"] / plain_runs[c]["e2e_tokens_per_s"]
                                  for c in bi_runs if c in plain_runs}
    _save(results)
    print(f"\npeak fp32 matmul {peak / 1e9:.1f} GFLOP/s; params {results['params'] / 1e6:.1f}M; "
          f"roofline {results['roofline_tokens_per_s']:.0f} tok/s")
    print("| concurrency | BI e2e tok/s | BI decode tok/s | BI decode / roofline | plain e2e tok/s | "
          "plain decode tok/s | invariance cost (e2e) |")
    print("|---|---|---|---|---|---|---|")
    for c in [c for c in levels if c in plain_runs]:
        b, pl = bi_runs[c], plain_runs[c]
        print(f"| {c} | {b['e2e_tokens_per_s']:.1f} | {b['decode_tokens_per_s'] or 0:.1f} | "
              f"{100 * b.get('decode_fraction_of_roofline', 0):.0f}% | {pl['e2e_tokens_per_s']:.1f} | "
              f"{pl['decode_tokens_per_s'] or 0:.1f} | {100 * results['invariance_cost'][c]:.0f}% |")
    print(f"roofline measured in this run: {peak / 1e9:.1f} GFLOP/s peak fp32 matmul")
    print(f"peak RSS {rss / 2**20:.0f} MiB (bound: model + KV budget + 500 MiB = "
          f"{results['rss_bound_bytes'] / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
