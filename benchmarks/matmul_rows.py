"""The cost of a step's rows: every quantized matrix of the default model, multiplied at M = 1..10 rows.

Sizes speculation (engine/speculation.py ROW_COST and the register rows of kernels/csrc/qmm_*.cpp): up to
the build's register rows each weight is dequantized once for all rows, so a row adds only its FMAs; past
them the cost jumps. Prints best-of-7 milliseconds per pass over all matrices, and the ratio to M = 1.

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
        print(f"M={m:2d} {best * 1e3:7.2f} ms  x{best / base:.2f}")


if __name__ == "__main__":
    main()
