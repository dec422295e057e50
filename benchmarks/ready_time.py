"""Ready-to-serve time on a warm page cache: steadyserve against llama.cpp's llama-server, on one GGUF, in one run.

Issue 62's target: steadyserve's ready time at most 2x llama-server's. Each server is started --rounds times,
alternating (llama-server, steadyserve, steadyserve, llama-server, ...) so a drift of the machine falls on both,
after one unmeasured start of each: the first reads the file into the page cache and lets steadyserve write its
packed-weight cache (models/packed_cache.py), as an operator's restart after the first deployment would find them.
"Ready" is the moment the server answers: llama-server's /health with 200 (it answers 503 while loading), and
steadyserve's ready file (written once the model is loaded, self-tested and the ports listen). Both with the same
threads; the figure is the median over rounds.

    .venv/bin/python benchmarks/ready_time.py FILE.gguf --llama-cpp /tmp/llama/bin [--rounds 3] [--out JSON]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
from pathlib import Path

from peers import Peer, cpu_name, free_port, thread_env

from steadyserve.testing.server import ServerProcess

HERE = Path(__file__).parent


def llama_ready(bin_dir: Path, gguf: str, threads: int, ctx: int) -> float:
    port, t0 = free_port(), time.monotonic()
    peer = Peer("llama-server", [str(bin_dir / "llama-server"), "-m", gguf, "-t", str(threads), "-c", str(ctx),
                                 "--host", "127.0.0.1", "--port", str(port)],
                thread_env(threads), "/health", {"port": port, "threads": threads}, startup_timeout=900)
    took = time.monotonic() - t0
    peer.stop()
    return took


def steadyserve_ready(gguf: str, threads: int, kv: str) -> float:
    t0 = time.monotonic()
    with ServerProcess(gguf, "--kv-cache-memory", kv, threads=threads, startup_timeout=900):
        return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("--llama-cpp", type=Path, required=True, help="the folder of a llama-server build")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv", default="2GiB", help="steadyserve's --kv-cache-memory")
    ap.add_argument("--ctx", type=int, default=16384, help="llama-server's -c (its KV cache: 2 GiB at 8B, f16)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "ready_time.json")
    a = ap.parse_args()
    load_before = os.getloadavg()
    warm = {"llama-server": llama_ready(a.llama_cpp, a.gguf, a.threads, a.ctx),
            "steadyserve": steadyserve_ready(a.gguf, a.threads, a.kv)}
    times: dict[str, list[float]] = {"llama-server": [], "steadyserve": []}
    for r in range(a.rounds):
        for name in (("llama-server", "steadyserve") if r % 2 == 0 else ("steadyserve", "llama-server")):
            took = llama_ready(a.llama_cpp, a.gguf, a.threads, a.ctx) if name == "llama-server" \
                else steadyserve_ready(a.gguf, a.threads, a.kv)
            times[name].append(round(took, 2))
            print(f"round {r}: {name} ready after {took:.2f} s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": cpu_name(), "threads": a.threads,
           "gguf": Path(a.gguf).name, "gguf_bytes": Path(a.gguf).stat().st_size,
           "first_start_s": {k: round(v, 2) for k, v in warm.items()}, "ready_s": times,
           "median_ready_s": med, "ratio_steadyserve_to_llama": round(med["steadyserve"] / med["llama-server"], 2),
           "target_ratio_at_most": 2.0, "settings": {"kv": a.kv, "llama_ctx": a.ctx, "rounds": a.rounds},
           "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("median_ready_s", "ratio_steadyserve_to_llama")}))


if __name__ == "__main__":
    main()
