#!/usr/bin/env python3
"""Same bits on other CPUs? The engine's logprobs natively and under qemu-user emulating an Intel and an AMD CPU.

    python scripts/fleet_check.py [--golden] [--out benchmarks/results/fleet_check.json]   (make fleet-check)

The machines this project runs on change kind between sessions, and a fleet mixes them. qemu-user
(Debian's qemu-user) runs this very venv's Python on an emulated CPU whose CPUID names another
vendor and ISA: `-cpu Haswell` is a GenuineIntel CPU with AVX2 (MKL then takes its Intel AVX2
branch, which it never takes on AMD), `-cpu EPYC-Rome` an AuthenticAMD CPU with AVX2. qemu's
emulation computes each instruction's IEEE result exactly, so what differs is which code the
libraries pick, which is the point. TCG emulates no AVX-512: an AVX-512 Xeon is not covered.

For each CPU and each numerics path (int8, the default; portable; host), scripts/numerics_probe.py
runs a fixed score and greedy generation through the engine on a 2-layer model of SmolLM2-135M's
widths (built here; int8 on its Q4_1 GGUF). The verdict: every int8 vector equal and every portable
vector equal (the native paths' promise; their kernels run the AVX-512 build natively here and the
AVX2 build under the emulated CPUs), and how many distinct host vectors there are (host numerics
make no promise across machine kinds; distinct host vectors show that the emulation really changed
the kernels). `--golden` also checks the default model's golden files (tests/golden/<path>_smollm2.json)
under the emulated Intel CPU (about 20 minutes). Exit status 1 when a native path's vectors differ
or a golden check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

# name -> qemu-user -cpu model (None: this machine, natively)
CPUS = {"native": None, "intel-haswell-avx2": "Haswell", "amd-epyc-rome-avx2": "EPYC-Rome"}
# Portable numerics need no environment: the native kernels pick their vector build by CPUID (under qemu:
# the emulated CPU's AVX2 build) and compute the same bits with each.
PORTABLE = {"STEADYSERVE_NUMERICS": "portable"}
INT8 = {"STEADYSERVE_NUMERICS": "int8"}  # on a Q4_1 GGUF of the same model: int8 packs quantized matrices only
HOST = {"STEADYSERVE_NUMERICS": "host", "MKL_CBWR": "AUTO,STRICT"}
ENVS = {"portable": PORTABLE, "int8": INT8, "host": HOST}
MODES = tuple(ENVS)
SAME_BITS = ("portable", "int8")  # the paths that promise one vector on every CPU


def qemu() -> str:
    path = shutil.which("qemu-x86_64")
    if path:
        return path
    if os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run("apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user",
                       shell=True, check=False, capture_output=True)
    path = shutil.which("qemu-x86_64")
    if not path:
        sys.exit("fleet_check: qemu-x86_64 not found and cannot be installed (apt-get install qemu-user)")
    return path


def run(cpu: str | None, argv: list[str], env: dict[str, str], timeout: float) -> tuple[str, float]:
    """Run the venv's Python with argv, natively or under qemu-user -cpu `cpu`; returns (stdout, seconds).
    The environment names the numerics path (STEADYSERVE_NUMERICS, read by numerics_probe.py)."""
    prefix = [qemu(), "-cpu", cpu] if cpu else []
    t0 = time.monotonic()
    r = subprocess.run([*prefix, sys.executable, *argv], env={**os.environ, **env}, capture_output=True,
                       text=True, timeout=timeout)
    if r.returncode not in (0, 1):
        raise RuntimeError(f"{cpu or 'native'}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r.stdout, time.monotonic() - t0


def probe(cpu: str | None, mode: str, model: str) -> dict:
    out, seconds = run(cpu, [str(ROOT / "scripts" / "numerics_probe.py"), model], ENVS[mode], timeout=3600)
    line = next(x for x in out.splitlines() if x.startswith("PROBE "))
    banner = next((x for x in out.splitlines() if x.startswith("MKL_VERBOSE oneMKL")), "")
    return {**json.loads(line[6:]), "mkl_branch": banner.split(" for ", 1)[-1].split(",")[0],
            "seconds": round(seconds, 1)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--golden", action="store_true", help="also check the default model's golden file on Intel")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "fleet_check.json"))
    a = p.parse_args(argv)
    from steadyserve.platform_info import platform_info
    from steadyserve.testing import build_tiny_model
    from steadyserve.testing.tiny_gguf import write_tiny_gguf

    tmp = tempfile.mkdtemp(prefix="fleet-check-")
    try:
        model = str(build_tiny_model(Path(tmp) / "smolwidth", arch="llama", size="smolwidth"))
        gguf = str(write_tiny_gguf(model, Path(tmp) / "smolwidth-q4_1.gguf", quant="Q4_1"))
        runs = []
        for name, cpu in CPUS.items():
            for mode in MODES:
                r = {"cpu": name, "qemu_cpu": cpu, "mode": mode, **probe(cpu, mode, gguf if mode == "int8" else model)}
                print(f"{name:<20} {mode:<8} numerics {r['numerics_id']} torch {r['isa']:<6} MKL branch "
                      f"{r['mkl_branch']!r}: {len(r['logprobs'])} logprobs, {r['seconds']} s", flush=True)
                runs.append(r)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    vectors = {mode: {json.dumps([r["tokens"], r["logprobs"]]) for r in runs if r["mode"] == mode} for mode in MODES}
    report = {"machine": {"cpu_model": platform_info().cpu_model, "python": platform.python_version()},
              "model": "tiny llama, SmolLM2-135M widths, 2 layers (steadyserve.testing, seed 0); int8: its Q4_1 GGUF",
              "runs": runs, **{f"distinct_{mode}_vectors": len(vectors[mode]) for mode in MODES}}
    ok = all(len(vectors[mode]) == 1 for mode in SAME_BITS)
    print(", ".join(f"{mode}: {len(vectors[mode])} distinct vector(s)" for mode in MODES)
          + f" over {len(CPUS)} CPUs ({'same bits' if ok else 'DIFFERENT BITS'} where promised)")
    if a.golden:
        for mode in SAME_BITS:
            out, seconds = run(CPUS["intel-haswell-avx2"], ["-m", "steadyserve.tools.golden", "--numerics", mode,
                                                            "--check", str(ROOT / "tests" / "golden" / f"{mode}_smollm2.json")],
                               ENVS[mode], timeout=7200)
            verdict = next((x for x in out.splitlines() if x.startswith(("golden", "GOLDEN"))), out[-500:])
            report[f"golden_{mode}_on_intel_haswell"] = {"result": verdict, "seconds": round(seconds, 1)}
            ok = ok and verdict.startswith("golden vectors bitwise equal")
            print(f"{mode} golden file under intel-haswell-avx2 ({seconds:.0f} s): {verdict}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
