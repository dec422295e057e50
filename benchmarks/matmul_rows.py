"""The cost of a step's rows: every quantized matrix of the default model, multiplied at M = 1..10 rows.

Sizes speculation (engine/speculation.py ROW_COST and the register rows of kernels/csrc/qmm_*.cpp): up to
the build's register rows each weight is dequantized once for all rows, so a row adds only its FMAs; past
them the cost jumps. Prints best-of-7 milliseconds per pass over all matrices, and the ratio to M = 1.
Then what bounds a row's cost from below: the multiply-adds one more row adds, as GFLOP/s (the slope of
the time over M = 1 to the register rows), against this machine's float32 peak as MKL's sgemm reaches it
on the same threads (a large square product, which runs at the FMA units' rate).

    .venv/bin/python benchmarks/matmul_rows.py [--threads 2] [--isa -1|0|1|2]
"""

from __future__ import annotations

import argparse
import time

import torch

from steadyserve.kernels.quant import QMatrix
from steadyserve.models.loader import load_model


def matrices(root: object) -> list[QMatrix]:
    """Every QMatrix reachable from the model's modules and their plain attributes."""
    found: list[QMatrix] = []
    seen: set[int] = set()

    def walk(o: object, depth: int) -> None:
        if depth > 6 or id(o) in seen:
            return
        seen.add(id(o))
        if isinstance(o, QMatrix):
            found.append(o)
        elif isinstance(o, torch.nn.Module):
            for v in [*vars(o).values(), *o.children()]:
                walk(v, depth + 1)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v, depth + 1)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v, depth + 1)
        elif hasattr(o, "__dict__") and type(o).__module__.startswith("steadyserve"):
            for v in vars(o).values():
                walk(v, depth + 1)

    walk(root, 0)
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--isa", type=int, default=-1, help="-1 the best build, 0 scalar, 1 AVX2, 2 AVX-512")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    mats = matrices(load_model("").model)
    print(f"{len(mats)} matrices, register rows {torch.ops.steadyserve.qmm_register_rows()}")
    base = 0.0
    times: dict[int, float] = {}
    for m in range(1, 11):
        xs = [torch.randn(m, q.k) for q in mats]
        ys = [torch.empty(m, q.n) for q in mats]
        best = float("inf")
        for _ in range(7):
            t0 = time.perf_counter()
            for q, x, y in zip(mats, xs, ys):
                q(x, a.isa, y)
            best = min(best, time.perf_counter() - t0)
        base = base or best
        times[m] = best
        print(f"M={m:2d} {best * 1e3:7.2f} ms  x{best / base:.2f}")
    rows = torch.ops.steadyserve.qmm_register_rows()
    flop_per_row = 2 * sum(q.n * q.k for q in mats)
    ms = list(range(1, rows + 1))  # the least-squares slope of time over M = 1..rows: seconds per row
    mean_m, mean_t = sum(ms) / len(ms), sum(times[m] for m in ms) / len(ms)
    slope = sum((m - mean_m) * (times[m] - mean_t) for m in ms) / sum((m - mean_m) ** 2 for m in ms)
    row_gflops = flop_per_row / slope / 1e9
    peak = sgemm_gflops()
    print(f"one more row: {flop_per_row / 1e6:.0f} MFLOP, {row_gflops:.1f} GFLOP/s (M=1..{rows}); "
          f"MKL sgemm 2048^3 {peak:.1f} GFLOP/s: rows run at {row_gflops / peak:.0%} of the float32 peak")


def sgemm_gflops(n: int = 2048) -> float:
    """Best of 5 float32 (n, n) @ (n, n) products, in GFLOP/s."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(5))
    return 2 * n**3 / best / 1e9


def _timed(f) -> float:  # noqa: ANN001 - a thunk
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
