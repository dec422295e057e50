"""CPU contention: steadyserve and llama-server on a quiet machine, beside a busy neighbour, and in a CPU quota.

One run, the default model, servers one at a time, streaming /v1/completions (64 output tokens, `ignore_eos`):
- quiet: each server alone (steadyserve with default flags: its threads from the CPU budget, adaptive; llama-server
  -t 2, its OMP threads spinning as shipped);
- busy: the same with one `python3 -c 'while True: pass'` beside it for the whole measurement (killed after);
- quota: steadyserve started inside a cgroup with a 1-CPU CFS quota (100 ms per 100 ms), default flags, and with
  `--threads 1` in the same quota (the cgroup is made by steadyserve.testing.cgroups; root is needed).
At c=1 (8 requests) and c=64 (64 requests). Ratios against the issue's targets are in the JSON: busy / quiet >= 0.4
at c=1 and c=64; quota default / quota --threads 1 >= 0.9.

    .venv/bin/python benchmarks/cpu_contention.py [--llama-cpp DIR] [--levels 1,64] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from gguf_serving import bench
from int8_serving import start_llama_server
from peers import cpu_name, warm_up

from steadyserve.models.loader import default_model_path
from steadyserve.testing.cgroups import cpu_quota_cgroup
from steadyserve.testing.server import ServerProcess

HERE = Path(__file__).parent


def measure(url: str, levels: list[int], tokens: int, requests: int = 8) -> dict[str, float]:
    warm_up(url)
    out = {}
    for c in levels:
        r = bench(url, c, c if c >= 16 else requests, tokens, None, True)
        out[f"c{c}"] = r["output_tokens_per_s"]
        print(f"    c={c}: {out[f'c{c}']:.1f} tok/s", file=sys.stderr, flush=True)
    return out


def busy_neighbour() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 900\nwhile time.time() < end: pass"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-cpp", type=Path, default=Path(os.environ.get("LLAMA_CPP_BIN", "/tmp/llama/bin")))
    p.add_argument("--levels", default="1,64")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=HERE / "results" / "cpu_contention.json")
    p.add_argument("--only", default="quiet,busy,quota", help="which conditions to run (a subset keeps the others "
                                                                 "from a previous --out file)")
    a = p.parse_args()
    levels = [int(x) for x in a.levels.split(",")]
    gguf = default_model_path()
    res: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"), "cpu": cpu_name(),
                 "cpus": os.cpu_count(), "gguf": Path(gguf).name, "output_tokens": a.output_tokens,
                 "command": " ".join([".venv/bin/python benchmarks/cpu_contention.py", *sys.argv[1:]]), "runs": {}}
    common = ("--kv-cache-memory", "1GiB", "--max-num-seqs", "64", "--max-queue", "512")
    only = set(a.only.split(","))
    if a.out.exists() and only != {"quiet", "busy", "quota"}:
        res["runs"] = json.loads(a.out.read_text()).get("runs", {})
    for cond in [c for c in ("quiet", "busy") if c in only]:
        for name in ("steadyserve", "llama-server"):
            print(f"{name}, {cond}", file=sys.stderr, flush=True)
            if name == "steadyserve":
                sp = ServerProcess("", *common, threads=0)
                url, stop = sp.http_url, sp.stop
            else:
                srv = start_llama_server(a.llama_cpp, gguf, 2, repack=True)
                url, stop = srv.url, srv.stop
            hog = busy_neighbour() if cond == "busy" else None
            res.setdefault("conditions", {})[f"{name} {cond}"] = datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds")
            try:
                # llama-server's spinning OMP threads collapse beside a neighbour (1-5 tok/s): c=1 only, 2 requests
                busy_peer = name == "llama-server" and cond == "busy"
                res["runs"][f"{name} {cond}"] = measure(url, levels[:1] if busy_peer else levels, a.output_tokens,
                                                        2 if busy_peer else 8)
                if name == "steadyserve":
                    metrics = __import__("httpx").get(url + "/metrics", timeout=10).text
                    res["runs"][f"{name} {cond}"]["threads_at_end"] = next(
                        (float(x.split()[-1]) for x in metrics.splitlines() if x.startswith("steadyserve_threads ")), -1)
            finally:
                if hog:
                    hog.kill()
                    hog.wait()
                stop()
            time.sleep(2)
    for label, threads in [x for x in (("quota default", 0), ("quota --threads 1", 1)) if "quota" in only]:
        print(f"steadyserve, {label}", file=sys.stderr, flush=True)
        with cpu_quota_cgroup(100000) as cg:
            sp = ServerProcess("", *common, threads=threads, cgroup=str(cg.path))
            try:
                res["runs"][f"steadyserve {label}"] = measure(sp.http_url, levels, a.output_tokens)
            finally:
                sp.stop()
        time.sleep(2)
    r = res["runs"]
    ratios = {}
    for name in ("steadyserve", "llama-server"):
        for c in levels:
            if f"c{c}" in r.get(f"{name} busy", {}) and f"c{c}" in r.get(f"{name} quiet", {}):
                ratios[f"{name} c{c} busy / quiet (target >= 0.4)"] = r[f"{name} busy"][f"c{c}"] / r[f"{name} quiet"][f"c{c}"]
    for c in levels:
        if "steadyserve quota default" in r and "steadyserve quota --threads 1" in r:
            ratios[f"steadyserve c{c} quota default / quota --threads 1 (target >= 0.9)"] = (
                r["steadyserve quota default"][f"c{c}"] / r["steadyserve quota --threads 1"][f"c{c}"])
    res["ratios"] = ratios
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(ratios, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
