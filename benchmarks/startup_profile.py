"""Where a server's start-up time and memory go: `steadyserve serve` on one file, its RSS sampled throughout.

Starts the real server (JSON logs, --ready-file), samples /proc/PID/status (VmRSS, VmHWM) every 50 ms, and
stamps each log line with the RSS at the moment it arrived, until the ready file appears; then stops the
server. Prints one JSON object: ready seconds, peak RSS (VmHWM), the file's size, the KV budget, the margin
left under file + KV + 600 MiB, and every log line (with progress lines) with its time and RSS.

    .venv/bin/python benchmarks/startup_profile.py FILE.gguf [--kv 512MiB] [--out results.json] [serve args]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MiB = 1024**2


def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "VmHWM:", "RssFile:", "RssAnon:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def profile(path: Path, kv: str, extra: list[str]) -> dict:
    ready = Path(tempfile.mkdtemp()) / "ready.json"
    cmd = [sys.executable, "-m", "steadyserve", "serve", "--model", str(path), "--kv-cache-memory", kv,
           "--http-port", "0", "--grpc-port", "0", "--ready-file", str(ready), "--log-format", "json", *extra]
    load_before = Path("/proc/loadavg").read_text().split()[:3]  # the CPU is shared: say how busy it was
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[dict] = []
    samples: list[tuple[float, int]] = []

    def read() -> None:
        assert proc.stderr is not None
        for raw in proc.stderr:
            st = _status(proc.pid)
            try:
                rec = json.loads(raw)
            except ValueError:
                rec = {"msg": raw.rstrip()}
            lines.append({"t": round(time.monotonic() - t0, 2), "rss_mib": st.get("VmRSS", 0) // MiB,
                          "hwm_mib": st.get("VmHWM", 0) // MiB, **rec})

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    hwm = 0
    while not ready.exists() and proc.poll() is None:
        st = _status(proc.pid)
        hwm = max(hwm, st.get("VmHWM", 0))
        samples.append((time.monotonic() - t0, st.get("VmRSS", 0)))
        time.sleep(0.05)
    ready_s = time.monotonic() - t0
    st = _status(proc.pid)
    hwm = max(hwm, st.get("VmHWM", 0))
    proc.terminate()
    proc.wait(30)
    reader.join(5)
    from steadyserve.config import parse_size

    kv_bytes = parse_size(kv, "--kv")
    size = path.stat().st_size
    return {"file": str(path), "file_bytes": size, "kv_bytes": kv_bytes, "ready_s": round(ready_s, 2),
            "exit": proc.returncode if not ready.exists() else None,
            "peak_rss_mib": hwm // MiB, "rss_at_ready_mib": st.get("VmRSS", 0) // MiB,
            "target_mib": (size + kv_bytes) // MiB + 600, "over_target_mib": (hwm - size - kv_bytes) // MiB - 600,
            "cpu": _cpu(), "loadavg_before": load_before, "loadavg_after": Path("/proc/loadavg").read_text().split()[:3],
            "lines": lines}


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip() + f", {os.cpu_count()} CPUs"
    return "?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", type=Path)
    p.add_argument("--kv", default="512MiB")
    p.add_argument("--out", type=Path)
    a, serve_args = p.parse_known_args()  # the rest go to `steadyserve serve`
    result = profile(a.file, a.kv, serve_args)
    text = json.dumps(result, indent=1)
    if a.out:
        a.out.write_text(text)
    summary = {k: v for k, v in result.items() if k != "lines"}
    print(json.dumps(summary))
    for ln in result["lines"]:
        if ln.get("logger") == "steadyserve.progress" and "done" not in ln.get("msg", ""):
            continue
        print(ln["t"], ln["rss_mib"], ln["hwm_mib"], ln.get("msg", "")[:60],
              {k: v for k, v in ln.items() if k in ("load_s", "detail", "weights_bytes", "phase", "done_bytes")})


if __name__ == "__main__":
    main()
