"""The cost of a step's rows: every quantized matrix of the default model, multiplied at M = 1..10 rows.

Sizes speculation (engine/speculation.py ROW_COST and the register rows of kernels/csrc/qmm_*.cpp): up to
the build's register rows each weight is dequantized once for all rows, so a row adds only its FMAs; past
them the cost jumps. Prints the best of 7 passes over all matrices (M interleaved), in ms, and the ratio
to M = 1.
Then what bounds a row's cost from below: the multiply-adds one more row adds, as GFLOP/s (the slope of
the time over M = 1 to the register rows), against this machine's float32 FMA peak
on the same threads (independent FMA chains in a small C++ loop, compiled here).

    .venv/bin/python benchmarks/matmul_rows.py [--threads 2] [--isa -1|0|1|2] [--model GGUF --numerics int8]

With --model and --numerics it walks that model as loaded for those numerics (the int8 path's packed panels),
and prints what M = 1 streams: the matrices' bytes over the pass's time, against torch.sum's read bandwidth;
for int8, also the multiply-adds per second at M = 16, 64 and 256 against the AVX-512 VNNI instruction's peak,
per build (VNNI, and AMX where the CPU has it).
"""

from __future__ import annotations

import argparse
import time

import torch

from gguf_serving import read_bandwidth_gb_s
from steadyserve.kernels.build import INT8_BUILDS
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
    p.add_argument("--model", default="", help="a GGUF (default: the default model)")
    p.add_argument("--numerics", default="auto")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    mats = matrices(load_model(a.model, numerics=a.numerics).model)
    if a.numerics == "int8":  # the packed panels it multiplies, not a tied embedding's rows kept for lookups
        mats = [q for q in mats if all(p.packed for p in q.parts)]
    print(f"{len(mats)} matrices, register rows {torch.ops.steadyserve.qmm_register_rows()}")
    inputs = {m: ([torch.randn(m, q.k) for q in mats], [torch.empty(m, q.n) for q in mats]) for m in range(1, 11)}
    times = {m: float("inf") for m in inputs}
    for rep in range(10):  # round-robin over M, so a slow spell of the machine hits every M alike
        for m, (xs, ys) in inputs.items():
            t0 = time.perf_counter()
            for q, x, y in zip(mats, xs, ys):
                q(x, a.isa, y)
            if rep >= 3:  # the first passes warm the threads and caches
                times[m] = min(times[m], time.perf_counter() - t0)
    for m, best in times.items():
        print(f"M={m:2d} {best * 1e3:7.2f} ms  x{best / times[1]:.2f}")
    nbytes = sum(q.nbytes for q in mats)
    bw = read_bandwidth_gb_s(a.threads) * 1e9
    print(f"M=1 streams {nbytes / 1e9:.3f} GB in {times[1] * 1e3:.2f} ms: {nbytes / times[1] / 1e9:.1f} GB/s, "
          f"{nbytes / times[1] / bw:.2f} of torch.sum's {bw / 1e9:.1f} GB/s on {a.threads} threads")
    if a.numerics == "int8":  # the slope below sizes the float32 path's register rows; int8's bound is VNNI's
        against_plain_reads(mats, inputs[1])
        int8_against_vnni_peak(mats, a.threads)
        return
    # the register rows of the build that ran (kSmallM of kernels/csrc/qmm_{scalar,avx2,avx512}.cpp)
    rows = {0: 1, 1: 4, 2: 8}.get(a.isa) or torch.ops.steadyserve.qmm_register_rows()
    flop_per_row = 2 * sum(q.n * q.k for q in mats)
    ms = list(range(1, rows + 1))  # the least-squares slope of time over M = 1..rows: seconds per row
    mean_m, mean_t = sum(ms) / len(ms), sum(times[m] for m in ms) / len(ms)
    slope = sum((m - mean_m) * (times[m] - mean_t) for m in ms) / sum((m - mean_m) ** 2 for m in ms)
    row_gflops = flop_per_row / slope / 1e9
    peak = fma_peak_gflops(a.threads, a.isa)
    print(f"one more row: {flop_per_row / 1e6:.0f} MFLOP, {row_gflops:.1f} GFLOP/s (M=1..{rows}); float32 FMA "
          f"peak of {a.threads} threads {peak:.1f} GFLOP/s: rows run at {row_gflops / peak:.0%} of it, so a row "
          f"costs at least {flop_per_row / peak * 1e-6:.2f} ms ({flop_per_row / peak / 1e9 / times[1]:.3f} of the "
          f"M = 1 pass; divide by an engine step's ms for speculation's row cost)")


# Independent FMA chains, more than the FMA units' latency times their count, so the loop runs at their
# throughput: the float32 peak of one core, at one vector width.
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
static volatile float results;  // where the chains' values go, so that no compiler drops them
double fma_peak_gflops(int64_t threads, bool avx512) {
  const long n = 50000000;
  std::vector<float> sink(threads);
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t)
    pool.emplace_back([&, t] { sink[t] = avx512 ? chains512(n) : chains256(n); });
  for (auto& th : pool) th.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (float v : sink) results = v;
  return double(threads) * n * 12 * (avx512 ? 16 : 8) * 2 / s / 1e9;
}
// The same for the int8 family's instruction: 12 independent vpdpbusd chains on zmm registers; beside it the
// integer multiplies the int8 kernels issue next to it (vpdpwssd, vpmulld), for benchmarks/q8k_rates.py.
#define INT_CHAINS(BODY)                                                     \
  __m512i a[12], w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);           \
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_epi32(i);                  \
  for (long r = 0; r < n; ++r) {                                             \
    _Pragma("GCC unroll 12") for (int i = 0; i < 12; ++i) a[i] = BODY;       \
  }                                                                          \
  int32_t s = 0;                                                             \
  for (int i = 0; i < 12; ++i) s += _mm512_reduce_add_epi32(a[i]);           \
  return s;
#define VNNI __attribute__((target("avx512f,avx512vnni")))
VNNI static int32_t dots512(long n) { INT_CHAINS(_mm512_dpbusd_epi32(a[i], w, x)) }
VNNI static int32_t wdots512(long n) { INT_CHAINS(_mm512_dpwssd_epi32(a[i], w, x)) }
__attribute__((target("avx512f"))) static int32_t mulls512(long n) { INT_CHAINS(_mm512_mullo_epi32(a[i], w)) }
static volatile int32_t int_results;
// Instructions per second of `threads` threads: 0 vpdpbusd, 1 vpdpwssd, 2 vpmulld (zmm).
double int_rate(int64_t kind, int64_t threads) {
  const long n = 50000000;
  std::vector<int32_t> sink(threads);
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t)
    pool.emplace_back([&, t] { sink[t] = kind == 0 ? dots512(n) : kind == 1 ? wdots512(n) : mulls512(n); });
  for (auto& th : pool) th.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (int32_t v : sink) int_results = v;
  return double(threads) * n * 12 / s;
}
double vnni_peak_gmacs(int64_t threads) { return int_rate(0, threads) * 64 / 1e9; }
// Which instructions share vpdpbusd's pipes: 8 independent vpdpbusd chains with 4 instructions of one kind beside
// them per 8 (on registers of their own), one thread, in ns per vpdpbusd. Kinds: 0 none, 1 vmulps, 2 vfmadd231ps,
// 3 vcvtdq2ps, 4 vaddps, 5 vpaddd, 6 vpbroadcastd from memory: the operations of the int8 tiles' float tail and
// loads. Written in asm so that the compiler keeps each instruction as it is.
#define DP(A) asm volatile("vpdpbusd %2, %1, %0" : "+v"(A) : "v"(w), "v"(x))
#define X4(OP, R, S) \
  asm volatile(OP : "+v"(R[0]) : "v"(S)); asm volatile(OP : "+v"(R[1]) : "v"(S)); \
  asm volatile(OP : "+v"(R[2]) : "v"(S)); asm volatile(OP : "+v"(R[3]) : "v"(S));
template <int KIND>
VNNI static double mix(long n) {
  __m512i a0 = _mm512_set1_epi32(1), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5), iv[4] = {a0, a0, a0, a0};
  __m512 m = _mm512_set1_ps(1.0000001f), f[4] = {m, m, m, m};
  static int32_t mem[4] = {1, 2, 3, 4};
  auto t0 = std::chrono::steady_clock::now();
  for (long r = 0; r < n; ++r) {
    DP(a0); DP(a1); DP(a2); DP(a3); DP(a4); DP(a5); DP(a6); DP(a7);
    if constexpr (KIND == 1) { X4("vmulps %1, %0, %0", f, m) }
    if constexpr (KIND == 2) { X4("vfmadd231ps %1, %1, %0", f, m) }
    if constexpr (KIND == 3) { X4("vcvtdq2ps %0, %0", f, m) }
    if constexpr (KIND == 4) { X4("vaddps %1, %0, %0", f, m) }
    if constexpr (KIND == 5) { X4("vpaddd %1, %0, %0", iv, w) }
    if constexpr (KIND == 6) {
      for (int j = 0; j < 4; ++j) asm volatile("vpbroadcastd %1, %0" : "=v"(iv[j]) : "m"(mem[j]));
    }
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  int_results = _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a7), iv[0]));
  return s * 1e9 / (double(n) * 8);
}
#undef DP
#undef X4
double mix_ns(int64_t kind) {
  const long n = 50000000;
  switch (kind) {
    case 1: return mix<1>(n);
    case 2: return mix<2>(n);
    case 3: return mix<3>(n);
    case 4: return mix<4>(n);
    case 5: return mix<5>(n);
    case 6: return mix<6>(n);
    default: return mix<0>(n);
  }
}
"""


def against_plain_reads(mats: list[QMatrix], one_row: tuple[list[torch.Tensor], list[torch.Tensor]]) -> None:
    """The M = 1 pass against the plainest read of the same bytes in the same calls: one torch.sum per packed
    matrix, in the pass's order (best of 7 each, alternating). torch.sum over one 1 GiB buffer (the line above)
    reads in one call per thread; a step reads every matrix (97 of 2-83 MB at the 1.7B shape), each split over
    the threads, and pays each call's start and join."""
    bufs = [p.data.view(-1)[: p.data.numel() // 4 * 4].view(torch.float32) for q in mats for p in q.parts]
    nbytes = sum(b.numel() * 4 for b in bufs)
    xs, ys = one_row
    best = {"sum": float("inf"), "mm": float("inf")}
    for rep in range(8):
        for kind in best:
            t0 = time.perf_counter()
            if kind == "sum":
                for b in bufs:
                    b.sum()
            else:
                for q, x, y in zip(mats, xs, ys):
                    q(x, -1, y)
            if rep:
                best[kind] = min(best[kind], time.perf_counter() - t0)
    print(f"one torch.sum per packed matrix: {best['sum'] * 1e3:.2f} ms ({nbytes / best['sum'] / 1e9:.1f} GB/s); "
          f"the M = 1 pass beside it {best['mm'] * 1e3:.2f} ms: {best['sum'] / best['mm']:.2f} of that read")


def int8_against_vnni_peak(mats: list[QMatrix], threads: int) -> None:
    """Where M makes the int8 family compute-bound (a step of 16, 64 or 256 rows), its multiply-adds per second
    over every packed matrix (weights streamed from memory, as in a step), against the peak of the integer dot
    product its VNNI build is built on (AVX-512 VNNI vpdpbusd: 64 multiply-adds per instruction); on a CPU with
    AMX, the AMX build (tiles for 32 rows or more) beside the VNNI build at each M."""
    best_build = torch.ops.steadyserve.q8_isa()
    if best_build < 2:
        print("int8 rows: no AVX-512 VNNI build on this CPU, no VNNI peak to compare with")
        return
    macs = sum(q.n * q.k for q in mats)
    peak = max(_peak_ext().vnni_peak_gmacs(threads) for _ in range(3))
    for m in (16, 64, 256):
        xs, ys = [torch.randn(m, q.k) for q in mats], [torch.empty(m, q.n) for q in mats]
        for build in range(2, best_build + 1):
            best = float("inf")
            for rep in range(5 if m < 256 else 3):
                t0 = time.perf_counter()
                for q, x, y in zip(mats, xs, ys):
                    q(x, build, y)
                if rep >= 1:
                    best = min(best, time.perf_counter() - t0)
            rate = m * macs / best / 1e9
            print(f"int8 M={m} {INT8_BUILDS[build]}: {best * 1e3:.1f} ms, {rate:.1f} GMAC/s: {rate / peak:.0%} of "
                  f"the vpdpbusd peak of {threads} threads, {peak:.1f} GMAC/s")


def _peak_ext():  # the C++ above: built on first use, then loaded from torch's extension cache
    from torch.utils.cpp_extension import load_inline

    return load_inline("fma_peak", cpp_sources=_PEAK_SRC,
                       functions=["fma_peak_gflops", "vnni_peak_gmacs", "int_rate", "mix_ns"], extra_cflags=["-O2"])


def fma_peak_gflops(threads: int, isa: int) -> float:
    """The float32 FMA peak of `threads` cores (best of 3), in GFLOP/s, at the vector width the matmuls ran
    at (--isa; -1: the widest CPUID reports): a small C++ loop built here. The scalar build has no peak of
    its own here: it gets the AVX2 figure."""
    ext = _peak_ext()
    avx512 = isa == 2 or (isa == -1 and torch.backends.cpu.get_cpu_capability().startswith("AVX512"))
    return max(ext.fma_peak_gflops(threads, avx512) for _ in range(3))


if __name__ == "__main__":
    main()
