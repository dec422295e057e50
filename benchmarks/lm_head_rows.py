"""What the LM head's residual rows cost: the int8 path's head (q8.h, "Residual rows": each row's rounding residual
multiplied as a second int8 row) against the same packed matrix multiplied with one int8 row per activation row.

For each model: its head as the int8 path loads it, at M = 1 (a c=1 decode step) to 64 rows (a batch's decode
step, or a verify step of speculation), both orders interleaved, best of --repeat passes, in ms; the ratio is
residual / one row. One row per activation row is what the int8 path ran before the residual rows (numerics q8a2).

    .venv/bin/python benchmarks/lm_head_rows.py --models smollm2,gemma3-270m,PATH.gguf [--threads 2] [--out J]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from steadyserve.kernels.quant import FORMATS, PACKED, QMatrix
from steadyserve.models import known
from steadyserve.models.loader import load_model


def best_ms(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1000.0


def measure(path: str, ms: list[int], repeat: int) -> dict:
    head = load_model(path, numerics="int8").model.lm_head
    assert isinstance(head, QMatrix) and head.residual_rows, "the int8 path's head multiplies residual rows"
    one_row = QMatrix(head.parts)  # the same panels, one int8 row per activation row
    fmts = sorted({FORMATS[p.fmt - PACKED][0] if p.fmt >= PACKED else FORMATS[p.fmt][0] for p in head.parts})
    rows = []
    g = torch.Generator().manual_seed(0)
    for m in ms:
        x = torch.randn(m, head.k, generator=g)
        out = torch.empty(m, head.n)
        for _ in range(2):  # warm: workspaces, pages of out
            head(x, out=out)
            one_row(x, out=out)
        t_res, t_one = float("inf"), float("inf")
        for _ in range(3):  # the two orders interleaved, so a slow moment of the host hits both
            t_one = min(t_one, best_ms(lambda: one_row(x, out=out), repeat))
            t_res = min(t_res, best_ms(lambda: head(x, out=out), repeat))
        rows.append({"m": m, "one_row_ms": round(t_one, 3), "residual_ms": round(t_res, 3),
                     "ratio": round(t_res / t_one, 3)})
        print(f"  M = {m:3d}: one row {t_one:8.3f} ms, residual rows {t_res:8.3f} ms, ratio {t_res / t_one:.2f}",
              flush=True)
    return {"model": path, "vocab": head.n, "hidden": head.k, "formats": fmts, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,gemma3-270m", help="known names or GGUF paths, comma-separated")
    ap.add_argument("--ms", default="1,2,4,8,16,32,64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    results = []
    for name in a.models.split(","):
        path = name if name.endswith(".gguf") else str(known.resolve(name))
        print(f"{name}:", flush=True)
        results.append(measure(path, [int(m) for m in a.ms.split(",")], a.repeat))
    doc = {"cpu": platform.processor() or platform.machine(), "threads": a.threads, "models": results}
    try:
        with open("/proc/cpuinfo") as f:
            doc["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
