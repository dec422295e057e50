"""The cost of a step's rows: every quantized matrix of the default model, multiplied at M = 1..10 rows.

Sizes speculation (engine/speculation.py ROW_COST and the register rows of kernels/csrc/qmm_*.cpp): up to
the build's register rows each weight is dequantized once for all rows, so a row adds only its FMAs; past
them the cost jumps. Prints best-of-7 milliseconds per pass over all matrices, and the ratio to M = 1.
Then what bounds a row's cost from below: the multiply-adds one more row adds, as GFLOP/s (the slope of
the time over M = 1 to the register rows), against this machine's float32 FMA peak
on the same threads (independent FMA chains in a small C++ loop, compiled here).

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
    peak = fma_peak_gflops(a.threads)
    print(f"one more row: {flop_per_row / 1e6:.0f} MFLOP, {row_gflops:.1f} GFLOP/s (M=1..{rows}); float32 FMA "
          f"peak of {a.threads} threads {peak:.1f} GFLOP/s: rows run at {row_gflops / peak:.0%} of it, so a row "
          f"costs at least {flop_per_row / peak / 1e9 / times[1]:.3f} of a one-row step")


# Independent FMA chains, more than the FMA units' latency times their count, so the loop runs at their
# throughput: the float32 peak of one core. The vector width is the widest CPUID reports, as the kernels'.
_PEAK_SRC = r"""
#include <immintrin.h>
#include <chrono>
#include <thread>
#include <vector>
// One body per vector width, each compiled for its own ISA (a function of another target would not inline).
#define CHAINS(V, SET, FMA, ADD0)                                          \
  V a[12], x = SET(1.0000001f), y = SET(0.9999999f);                       \
  for (int i = 0; i < 12; ++i) a[i] = SET(float(i));                       \
  for (long r = 0; r < n; ++r) {                                           \
    _Pragma("GCC unroll 12") for (int i = 0; i < 12; ++i) a[i] = FMA(a[i], x, y); \
  }                                                                        \
  float s = 0;                                                             \
  for (int i = 0; i < 12; ++i) s += ADD0(a[i]);                            \
  return s;
__attribute__((target("avx512f"))) static float chains512(long n) {
  CHAINS(__m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_reduce_add_ps)
}
__attribute__((target("avx2,fma"))) static float first8(__m256 v) { return _mm256_cvtss_f32(v); }
__attribute__((target("avx2,fma"))) static float chains256(long n) {
  CHAINS(__m256, _mm256_set1_ps, _mm256_fmadd_ps, first8)
}
double fma_peak_gflops(int64_t threads, bool avx512) {
  const long n = 50000000;
  std::vector<float> sink(threads);
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t)
    pool.emplace_back([&, t] { sink[t] = avx512 ? chains512(n) : chains256(n); });
  for (auto& th : pool) th.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return double(threads) * n * 12 * (avx512 ? 16 : 8) * 2 / s / 1e9 + 0.0 * sink[0];
}
"""


def fma_peak_gflops(threads: int) -> float:
    """The float32 FMA peak of `threads` cores (best of 3), in GFLOP/s: a small C++ loop built here."""
    from torch.utils.cpp_extension import load_inline

    ext = load_inline("fma_peak", cpp_sources=_PEAK_SRC, functions=["fma_peak_gflops"], extra_cflags=["-O2"])
    avx512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    return max(ext.fma_peak_gflops(threads, avx512) for _ in range(3))


if __name__ == "__main__":
    main()
