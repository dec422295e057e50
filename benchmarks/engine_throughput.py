"""Engine throughput: batch-invariant vs plain vs transformers, in one run, as ratios.

SmolLM2-135M, float32, 2 threads. Each row runs in its own process, so each has
its own peak RSS and MKL runs as that row would run in production (steadyserve
sets MKL_CBWR=AUTO,STRICT; transformers runs without it):
  * steadyserve batch-invariant and `--no-batch-invariant`: decode tok/s (decode
    steps only) and end-to-end tok/s at each concurrency level, with
    `--prompt-len`-token prompts and `--output-len` outputs; prefill tok/s of one
    `--prefill-len`-token prompt; peak RSS against model + KV budget + 500 MiB;
  * transformers (benchmarks/hf_reference.py): `generate()` at batch 1 and with a
    static batch of the largest level, and one forward over the prefill prompt;
  * roofline: peak fp32 matmul FLOP/s (large torch.mm) / (2 x parameters);
  * steadyserve with portable numerics (the default since the native kernels: the GGUF's blocks
    as stored, the same bits on every x86-64 host) against the host path's (float32 + MKL) rows,
    as "portable_cost" (negative when portable is faster);
  * invariance cost measured apart: both steadyserve engines in one process, their
    decode steps alternated, so that machine drift between processes cannot pass
    for a cost (on these shared cores one pass swung 20%).

    .venv/bin/python benchmarks/engine_throughput.py [--levels 1,8,64] [--output-len 64] [--rounds 3]

Every row runs once per round (order rotated between rounds) and each figure is
the median over rounds; peak RSS is the maximum.
Writes benchmarks/results/engine_throughput.json and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from peers import cpu_name

HERE = Path(__file__).parent
KV_BUDGET = 1024 ** 3


def worker(a: argparse.Namespace) -> dict:
    """One steadyserve engine (invariant or plain) through every level, in this process."""
    import torch

    from steadyserve.config import EngineConfig
    from steadyserve.engine.engine import LLMEngine
    from steadyserve.engine.selftest import run_selftest
    from steadyserve.engine.sequence import Request, SamplingParams
    from steadyserve.models import load_model

    torch.set_num_threads(a.threads)
    bi = a.worker in ("batch_invariant", "portable")
    numerics = "portable" if a.worker == "portable" else "host"
    levels = [int(x) for x in a.levels.split(",")]
    lm = load_model("", batch_invariant=bi, numerics=numerics)
    cfg = EngineConfig(kv_cache_memory=KV_BUDGET, threads=a.threads, max_num_seqs=max(levels),
                       max_num_batched_tokens=max(2048, a.prefill_len), batch_invariant=bi, max_queue=max(levels),
                       numerics=numerics)
    engine = LLMEngine(lm, cfg)
    st = run_selftest(engine)
    vocab = lm.args.vocab_size
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    out: dict = {"selftest": st.detail, "kernel": lm.model.kernel_id, "params": lm.args.num_params,
                 "model_bytes": lm.args.num_params * 4, "levels": []}
    # Prefill: one prompt alone, one step (the token budget holds it whole); best of 3.
    times = []
    for i in range(3):
        engine.add_request(Request(f"prefill-{i}", prompt(a.prefill_len), SamplingParams(max_tokens=1, temperature=0)))
        while engine.has_work():
            _, s = engine.step()
            if s.num_tokens == a.prefill_len:
                times.append(s.duration)
    out["prefill"] = {"tokens": a.prefill_len, "seconds": min(times), "tokens_per_s": a.prefill_len / min(times)}
    for c in levels:
        for i in range(c):
            engine.add_request(Request(f"c{c}-{i}", prompt(a.prompt_len),
                                       SamplingParams(max_tokens=a.output_len, temperature=0, ignore_eos=True)))
        generated = decode_tokens = 0
        decode_time = 0.0
        t0 = time.perf_counter()
        while engine.has_work():
            _, s = engine.step()
            generated += s.num_generated
            if s.num_tokens == s.num_seqs:  # a pure decode step: one token per sequence
                decode_tokens += s.num_generated
                decode_time += s.duration
        wall = time.perf_counter() - t0
        out["levels"].append({"concurrency": c, "generated_tokens": generated, "wall_s": wall,
                              "e2e_tokens_per_s": generated / wall,
                              "decode_tokens_per_s": decode_tokens / decode_time if decode_time else None})
        print(f"{a.worker:16s} c={c:3d} decode {out['levels'][-1]['decode_tokens_per_s'] or 0:7.1f} tok/s "
              f"e2e {generated / wall:7.1f} tok/s", file=sys.stderr)
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out["rss_bound_bytes"] = out["model_bytes"] + KV_BUDGET + 500 * 1024 ** 2
    return out


def peak_matmul_flops(n: int = 2048, reps: int = 5) -> float:
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def interleaved(a: argparse.Namespace) -> dict:
    """Invariant and plain engines in one process, decode steps alternated: the invariance cost without
    the drift between processes and minutes (a step's median time per level, both engines)."""
    import torch

    from steadyserve.config import EngineConfig
    from steadyserve.engine.engine import LLMEngine
    from steadyserve.engine.selftest import run_selftest
    from steadyserve.engine.sequence import Request, SamplingParams
    from steadyserve.models import load_model

    torch.set_num_threads(a.threads)
    levels = [int(x) for x in a.levels.split(",")]
    engines = {}
    for bi in (True, False):
        cfg = EngineConfig(kv_cache_memory=KV_BUDGET // 2, threads=a.threads, max_num_seqs=max(levels),
                           max_num_batched_tokens=max(2048, a.prefill_len), batch_invariant=bi, max_queue=max(levels))
        engines[bi] = LLMEngine(load_model("", batch_invariant=bi, numerics="host"), cfg)  # the host path's cost
        run_selftest(engines[bi])
    out: dict = {"levels": []}
    for c in levels:
        times: dict[bool, list[float]] = {True: [], False: []}
        for bi, e in engines.items():
            rng = random.Random(c)  # the same prompts for both
            for i in range(c):
                e.add_request(Request(f"ab{c}-{i}", [rng.randrange(e.loaded.args.vocab_size) for _ in range(a.prompt_len)],
                                      SamplingParams(max_tokens=a.output_len, temperature=0, ignore_eos=True)))
            while True:  # prefill, until the first pure decode step
                _, s = e.step()
                if s.num_tokens == s.num_seqs:
                    break
        step = 0
        while all(e.has_work() for e in engines.values()):
            for bi in ((True, False) if step % 2 == 0 else (False, True)):
                _, s = engines[bi].step()
                if s.num_tokens == s.num_seqs == c:
                    times[bi].append(s.duration)
            step += 1
        for e in engines.values():
            while e.has_work():
                e.step()
        med = {bi: statistics.median(t) for bi, t in times.items()}
        out["levels"].append({"concurrency": c, "steps": min(len(t) for t in times.values()),
                              "invariant_step_s": med[True], "plain_step_s": med[False],
                              "invariance_cost": 1 - med[False] / med[True]})
        print(f"interleaved c={c:3d}: invariant {1e3 * med[True]:.1f} ms, plain {1e3 * med[False]:.1f} ms per "
              f"decode step", file=sys.stderr)
    return out


def median_of(runs: list) -> object:
    """The median of every float leaf over runs of the same shape; other leaves from the first run."""
    first = runs[0]
    if isinstance(first, dict):
        return {k: median_of([r[k] for r in runs]) for k in first}
    if isinstance(first, list):
        return [median_of(list(items)) for items in zip(*runs)]
    if isinstance(first, float):
        return statistics.median(runs)
    return first


def run_json(cmd: list[str], env: dict[str, str]) -> dict:
    res = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--levels", default="1,8,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="each row runs once per round; figures are medians")
    p.add_argument("--worker", choices=["batch_invariant", "plain", "portable", "interleaved"], help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(interleaved(a) if a.worker == "interleaved" else worker(a)))
        return 0
    levels = [int(x) for x in a.levels.split(",")]
    common = ["--levels", a.levels, "--prompt-len", str(a.prompt_len), "--output-len", str(a.output_len),
              "--prefill-len", str(a.prefill_len), "--threads", str(a.threads)]
    env = dict(os.environ)
    results: dict = {"date": datetime.date.today().isoformat(), "cpu": cpu_name(), "threads": a.threads,
                     "prompt_len": a.prompt_len, "output_len": a.output_len, "prefill_len": a.prefill_len,
                     "command": " ".join(["benchmarks/engine_throughput.py", *sys.argv[1:]]), "runs": {}}
    # transformers as its users run it: no steadyserve import, no MKL_CBWR.
    from steadyserve.models.loader import convert_gguf, default_model_path

    model_dir = str(convert_gguf(Path(default_model_path()))[0])
    hf_env = {k: v for k, v in env.items() if k != "MKL_CBWR"}
    commands = {mode: ([sys.executable, __file__, "--worker", mode, *common], env)
                for mode in ("batch_invariant", "plain", "portable")}
    commands["transformers"] = (
        [sys.executable, str(HERE / "hf_reference.py"), model_dir, "--batch", str(max(levels)), "--prompt-len",
         str(a.prompt_len), "--output-len", str(a.output_len), "--prefill-len", str(a.prefill_len),
         "--threads", str(a.threads)], hf_env)
    # Rounds, each row once per round, the order rotated: on a shared machine throughput drifts by 10-20%
    # between minutes, so one pass can flip a ratio near 1. Every figure is the median over rounds.
    import torch

    torch.set_num_threads(a.threads)
    peak_before = peak_matmul_flops()
    names = list(commands)
    raw: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(a.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            print(f"round {r + 1}/{a.rounds}: {name}", file=sys.stderr)
            raw[name].append(run_json(*commands[name]))
    results["rounds"] = a.rounds
    results["raw"] = raw
    for mode in ("batch_invariant", "plain", "portable"):
        results["runs"][mode] = median_of(raw[mode])
        results["runs"][mode]["peak_rss_bytes"] = max(x["peak_rss_bytes"] for x in raw[mode])
    results["transformers"] = median_of(raw["transformers"])
    results["interleaved"] = run_json([sys.executable, __file__, "--worker", "interleaved", *common], env)
    # The best of the measurement before the rows and this one: a shared machine is never faster than its
    # peak, so the larger reading is the closer one.
    peak = max(peak_before, peak_matmul_flops())
    bi, plain, hf = results["runs"]["batch_invariant"], results["runs"]["plain"], results["transformers"]
    roofline = peak / (2 * bi["params"])
    results.update(peak_matmul_gflops=peak / 1e9, roofline_tokens_per_s=roofline)
    by_c = {m: {r["concurrency"]: r for r in results["runs"][m]["levels"]} for m in results["runs"]}
    hf_decode = {1: hf["batch1"]["decode_tokens_per_s"], max(levels): hf[f"batch{max(levels)}"]["decode_tokens_per_s"]}
    ratios: dict = {"invariance_cost_e2e": {}, "invariance_cost_decode": {}, "decode_vs_transformers": {},
                    "decode_fraction_of_roofline": {}}
    for c in levels:
        b, pl = by_c["batch_invariant"][c], by_c["plain"][c]
        ratios["invariance_cost_e2e"][c] = 1 - b["e2e_tokens_per_s"] / pl["e2e_tokens_per_s"]
        ratios["invariance_cost_decode"][c] = 1 - b["decode_tokens_per_s"] / pl["decode_tokens_per_s"]
        ratios["decode_fraction_of_roofline"][c] = b["decode_tokens_per_s"] / roofline
        if c in hf_decode:
            ratios["decode_vs_transformers"][c] = b["decode_tokens_per_s"] / hf_decode[c]
    ratios["prefill_vs_transformers"] = bi["prefill"]["tokens_per_s"] / hf["prefill"]["tokens_per_s"]
    port = results["runs"]["portable"]
    ratios["portable_cost_decode"] = {c: 1 - by_c["portable"][c]["decode_tokens_per_s"] / by_c["batch_invariant"][c][
        "decode_tokens_per_s"] for c in levels}
    ratios["portable_cost_prefill"] = 1 - port["prefill"]["tokens_per_s"] / bi["prefill"]["tokens_per_s"]
    results["ratios"] = ratios
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "engine_throughput.json").write_text(json.dumps(results, indent=2))

    print(f"\n{results['cpu']}, {a.threads} threads; SmolLM2-135M fp32; prompts {a.prompt_len}, outputs "
          f"{a.output_len}; medians of {a.rounds} rounds; roofline {roofline:.0f} tok/s ({peak / 1e9:.0f} GFLOP/s peak fp32 matmul)")
    print("| concurrency | BI decode tok/s | plain decode tok/s | transformers decode tok/s | BI / transformers | "
          "BI e2e tok/s | plain e2e tok/s | invariance cost (decode / e2e) | BI decode of roofline |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in levels:
        b, pl = by_c["batch_invariant"][c], by_c["plain"][c]
        hf_c = f"{hf_decode[c]:.1f}" if c in hf_decode else "-"
        vs = f"{ratios['decode_vs_transformers'][c]:.2f}x" if c in hf_decode else "-"
        print(f"| {c} | {b['decode_tokens_per_s']:.1f} | {pl['decode_tokens_per_s']:.1f} | {hf_c} | {vs} | "
              f"{b['e2e_tokens_per_s']:.1f} | {pl['e2e_tokens_per_s']:.1f} | "
              f"{100 * ratios['invariance_cost_decode'][c]:.0f}% / {100 * ratios['invariance_cost_e2e'][c]:.0f}% | "
              f"{100 * ratios['decode_fraction_of_roofline'][c]:.0f}% |")
    print(f"| prefill {a.prefill_len} tokens | {bi['prefill']['tokens_per_s']:.0f} tok/s | "
          f"{plain['prefill']['tokens_per_s']:.0f} tok/s | {hf['prefill']['tokens_per_s']:.0f} tok/s (one forward) | "
          f"{ratios['prefill_vs_transformers']:.2f}x | | | | |")
    print("\nInvariance cost, both engines in one process, decode steps alternated (median step time):")
    print("| concurrency | invariant ms/step | plain ms/step | invariance cost |\n|---|---|---|---|")
    for lv in results["interleaved"]["levels"]:
        print(f"| {lv['concurrency']} | {1e3 * lv['invariant_step_s']:.1f} | {1e3 * lv['plain_step_s']:.1f} | "
              f"{100 * lv['invariance_cost']:.0f}% |")
    print("\nPortable numerics (the default: native kernels on the stored GGUF blocks) against --numerics host:")
    print("| concurrency | host decode tok/s | portable decode tok/s | cost of portability |\n|---|---|---|---|")
    for c in levels:
        print(f"| {c} | {by_c['batch_invariant'][c]['decode_tokens_per_s']:.1f} | "
              f"{by_c['portable'][c]['decode_tokens_per_s']:.1f} | {100 * ratios['portable_cost_decode'][c]:.0f}% |")
    print(f"| prefill {a.prefill_len} tokens | {bi['prefill']['tokens_per_s']:.0f} tok/s | "
          f"{port['prefill']['tokens_per_s']:.0f} tok/s | {100 * ratios['portable_cost_prefill']:.0f}% |")
    for m in ("batch_invariant", "plain", "portable"):
        r = results["runs"][m]
        print(f"peak RSS {m}: {r['peak_rss_bytes'] / 2**20:.0f} MiB (bound model + KV + 500 MiB = "
              f"{r['rss_bound_bytes'] / 2**20:.0f} MiB); kernel {r['kernel']}; self-test: {r['selftest']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
