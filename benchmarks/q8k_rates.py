"""The int8 matmul's integer-op rate against the peak of the instruction it is built on (issue 59, item 1).

(a) The peak: back-to-back vpdpbusd zmm (12 independent chains, 64 multiply-adds each) on 1 and 2 threads, from a
    small C++ loop compiled for the benchmark alone (benchmarks/matmul_rows.py's, a target attribute on that
    function only: never in the shipped library). Beside it, the throughput of the integer instructions a coarser
    order adds per sub-block (vpmulld, vpdpwssd), in instructions per ns per thread, to size them against vpdpbusd;
    and which operations of the float tail share its pipes (each one's cost in vpdpbusd slots, measured beside 8
    vpdpbusd chains), hence each format's bound: 8 vpdpbusd per block and row over 8 plus its tail's slots.
(b) The packed matmul y = x W^T at M = 256 and 1024, K = N = 2048, for Q4_K, Q6_K, Q4_0, Q4_1 and Q8_0 (--formats),
    1 and 2 threads, this CPU's widest int8 build: multiply-adds per second (M N K / time, best of --reps), their
    fraction of the vpdpbusd peak of the same thread count and of the tail's bound. Weights are random blocks with
    finite scales (speed does not depend on their values), packed once; the activations' quantization is inside
    each call, as in the engine.

    PYTHONPATH=src .venv/bin/python benchmarks/q8k_rates.py [--out benchmarks/results/q8k_rates_X.json] [--label X]
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import numpy as np
import torch

from peers import cpu_name
from matmul_rows import _peak_ext

# GGUF block bytes and the offsets of the float16 scale fields set to a small finite value (0.01 = 0x211F)
BLOCKS = {"Q4_K": (256, 144, (0, 2)), "Q6_K": (256, 210, (208,)), "Q4_0": (32, 18, (0,)), "Q4_1": (32, 20, (0, 2)),
          "Q8_0": (32, 34, (0,))}
FMT_IDS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q4_K": 12, "Q6_K": 14}


# Matrix mix_ns's kinds (benchmarks/matmul_rows.py) and the float tail of kernels/csrc/q8_body.h per block and
# activation row: t = float(I) * dx (vcvtdq2ps, vmulps), acc = fma(a, t, acc), and for formats with a minimum
# acc = fma(b, sxd, acc); Q6_K forms float(I) as fma(sc_lo, lo, sc_hi * hi) first. The panel's own per-block
# products (Q4_K's a and b), shared by a tile's 8 rows, are left out.
MIX_KINDS = {1: "vmulps", 2: "vfmadd231ps", 3: "vcvtdq2ps", 4: "vaddps", 5: "vpaddd", 6: "vpbroadcastd_load"}
_WITH_MIN = {"vcvtdq2ps": 1, "vmulps": 1, "vfmadd231ps": 2}
_NO_MIN = {"vcvtdq2ps": 1, "vmulps": 1, "vfmadd231ps": 1}
TAIL_OPS = {"Q4_K": _WITH_MIN, "Q4_1": _WITH_MIN, "Q4_0": _NO_MIN, "Q8_0": _NO_MIN,
            "Q6_K": {"vcvtdq2ps": 2, "vmulps": 2, "vfmadd231ps": 2}}


def random_matrix(name: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    block, nbytes, scales = BLOCKS[name]
    b = np.random.default_rng(seed).integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
    for off in scales:
        b[..., off], b[..., off + 1] = 0x1F, 0x21
    return torch.from_numpy(b.reshape(n, -1).copy())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="")
    p.add_argument("--label", default="")
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--formats", default="Q4_K,Q6_K,Q4_0,Q4_1,Q8_0")
    p.add_argument("--ms", default="256,1024")
    a = p.parse_args()
    from steadyserve.kernels import load
    from steadyserve.kernels.build import INT8_BUILDS
    from steadyserve.kernels.quant import PACKED

    st = load()
    assert st.available, st.detail
    ops = torch.ops.steadyserve
    ext = _peak_ext()  # benchmarks/matmul_rows.py's loops, compiled here for this benchmark alone
    out: dict = {"cpu": cpu_name(), "label": a.label, "date": datetime.datetime.now().isoformat(timespec="seconds"),
                 "kernels": st.detail, "build": INT8_BUILDS[ops.q8_isa()], "K": 2048, "N": 2048, "peak": {},
                 "matmul": []}
    for threads in (1, 2):
        per = {kind: max(ext.int_rate(i, threads) for _ in range(3)) for i, kind in enumerate(("vpdpbusd", "vpdpwssd",
                                                                                            "vpmulld"))}
        out["peak"][threads] = {"vpdpbusd_gmacs": per["vpdpbusd"] * 64 / 1e9,
                                **{f"{k}_per_ns_per_thread": v / 1e9 / threads for k, v in per.items()}}
        print(f"{threads} thread(s): vpdpbusd peak {per['vpdpbusd'] * 64 / 1e9:.1f} GMAC/s; per thread per ns: "
              + ", ".join(f"{k} {v / 1e9 / threads:.2f}" for k, v in per.items()), flush=True)
    # The float tail's share of the pipes: each operation's cost in vpdpbusd slots, measured beside 8 vpdpbusd
    # chains, then each format's bound (8 vpdpbusd per block and row, plus its tail: TAIL_OPS).
    base = min(ext.mix_ns(0) for _ in range(3))
    slots = {k: max(0.0, (min(ext.mix_ns(i) for _ in range(3)) / base - 1) * 2) for i, k in MIX_KINDS.items()}
    out["tail"] = {"ns_per_vpdpbusd": base, "slots_per_op": slots,
                   "bound": {f: 8 / (8 + sum(n * slots[k] for k, n in ops.items())) for f, ops in TAIL_OPS.items()}}
    print("vpdpbusd slots each op of the tail takes (4 per 8 vpdpbusd, one thread): "
          + ", ".join(f"{k} {v:.2f}" for k, v in slots.items()), flush=True)
    K = N = 2048
    threads0 = torch.get_num_threads()
    for name in a.formats.split(","):
        fmt = FMT_IDS[name]
        packed = ops.q8pack(random_matrix(name, N, K), fmt, K)
        for m in (int(v) for v in a.ms.split(",")):
            x = torch.randn(m, K, generator=torch.Generator().manual_seed(1))
            y = torch.empty(m, N)
            for threads in (1, 2):
                torch.set_num_threads(threads)
                ops.qmatmul_(x, packed, PACKED + fmt, y, 0, -1)  # warm
                best = float("inf")
                for _ in range(a.reps):
                    t0 = time.perf_counter()
                    ops.qmatmul_(x, packed, PACKED + fmt, y, 0, -1)
                    best = min(best, time.perf_counter() - t0)
                gmacs = m * N * K / best / 1e9
                frac = gmacs / out["peak"][threads]["vpdpbusd_gmacs"]
                out["matmul"].append({"format": name, "M": m, "threads": threads, "ms": best * 1e3, "gmacs": gmacs,
                                      "fraction_of_vpdpbusd_peak": frac})
                bound = out["tail"]["bound"][name]
                out["matmul"][-1]["fraction_of_tail_bound"] = frac / bound
                print(f"{name} M={m} threads={threads}: {best * 1e3:.1f} ms, {gmacs:.1f} GMAC/s, {frac:.1%} of the "
                      f"vpdpbusd peak, {frac / bound:.0%} of the tail's bound ({bound:.0%})", flush=True)
    torch.set_num_threads(threads0)
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
        print("wrote", a.out)


if __name__ == "__main__":
    main()
