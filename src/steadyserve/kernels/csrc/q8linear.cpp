// torch ops over the int8 family (q8.h): activations quantized to int8, weights packed in panels.
//
//   q8pack(w, fmt, K)                     a GGUF matrix (N, row_bytes) as packed panels (N, packed_row_bytes)
//   q8quantize(x, isa)                    (xq, dx): the activation quantization alone, for the tests
//   q8_isa()                              the int8 build this CPU runs: 0 scalar, 1 AVX2, 2 AVX-512 VNNI, 3 AMX
//   steady_q8_ops::matmul_packed          y[:, col0 : col0 + N] = x · Wᵀ; reached through qmatmul_ (qlinear.cpp)
//                                         when its format id is kPacked + a GGML type
//   steady_q8_ops::matmul_packed_groups   each group of rows of x times its own matrix (a sparse layer's experts,
//                                         moe.cpp), in one parallel region: every row as matmul_packed computes it
//   q8matmul_residual_(x, w, fmt, y, col0, margin, max_panels, isa)
//                                         the LM head's order (q8.h, "Residual rows"): y = x_q · Wᵀ, then + r_q · Wᵀ
//                                         on each row's panels near its top, r the row's rounding residual
//
// `isa` picks the build: -1 the best this CPU has (by CPUID), 0 scalar, 1 AVX2, 2 AVX-512 VNNI, 3 AMX; the tests
// run every one the machine has and compare bits. Threads split panels of 16 output columns, never a sum.
#include <ATen/ATen.h>
#include "fp_env.h"
#include <torch/library.h>


#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "isa.h"
#include "ops.h"
#include "q8.h"
#include "qmm.h"

namespace steady_q8_ops {

using namespace steady_q8;

namespace {

// How far ahead each thread asks for its weight stream (q8.h's Prefetch), chosen by measuring weights read from
// memory at 2 threads on each vendor's CPU (benchmarks/RESULTS.md, "Kernel tuning measurements"): AMD CPUs take the
// L2 hint alone, 7 KiB ahead; others an L1 hint 2 KiB and an L2 hint 12 KiB ahead. A hint never changes a value.
Prefetch prefetch_plan() {
  return steady_isa::cpu().amd ? Prefetch{0, 7168} : Prefetch{2048, 12288};
}

}  // namespace

int best_q8_isa() { return steady_isa::best_int8(); }

namespace {

struct Build {
  decltype(&scalar::matmul) matmul;
  decltype(&scalar::quantize_rows) quantize_rows;
  decltype(&scalar::panel_tops) panel_tops;
};
const Build kBuilds[4] = {{scalar::matmul, scalar::quantize_rows, scalar::panel_tops},
                          {avx2::matmul, avx2::quantize_rows, avx2::panel_tops},
                          {avx512::matmul, avx512::quantize_rows, avx512::panel_tops},
                          {amx::matmul, avx512::quantize_rows, avx512::panel_tops}};

int pick(int64_t isa) { return steady_isa::int8_build(isa, "steadyserve int8 op"); }

// Outputs a thread's run of panels holds in the residual op before their panels' largest are found (q8matmul_residual_):
// 256 KiB, within any L2 this family runs on. A speed knob only: which panels a call covers never changes a bit.
constexpr int64_t kTopsFloats = 64 * 1024;
// Panel maxima the residual op keeps allocated between calls, per thread: 4 MiB, 64 rows of a 262,144-token head.
constexpr int64_t kKeptTops = 1 << 20;

// Quantized activations of one call (q8.h): (M, K) int8 and per-block (M, K / 32) dx, sxd, sx, (M, K / 16) zx16.
struct Quantized {
  int8_t* xq;
  float *dx, *sxd;
  int32_t *sx, *zx16;
};

// Bytes of each array of Quantized for M rows of K, in its order, each rounded up to whole cache lines.
void quantized_sizes(int64_t M, int64_t K, int64_t (&bytes)[5]) {
  const int64_t blocks = K / kBlock;
  const int64_t raw[5] = {M * K, 4 * M * blocks, 4 * M * blocks, 4 * M * blocks, 8 * M * blocks};
  for (int i = 0; i < 5; ++i) bytes[i] = (raw[i] + 63) / 64 * 64;
}

// The arrays carved from one 64-byte-aligned buffer of at least the sizes' sum.
Quantized carve(uint8_t* p, const int64_t (&bytes)[5]) {
  Quantized q{};
  q.xq = reinterpret_cast<int8_t*>(p);
  q.dx = reinterpret_cast<float*>(p += bytes[0]);
  q.sxd = reinterpret_cast<float*>(p += bytes[1]);
  q.sx = reinterpret_cast<int32_t*>(p += bytes[2]);
  q.zx16 = reinterpret_cast<int32_t*>(p += bytes[3]);
  return q;
}

// The calling thread's quantization workspace, reused call after call: a decode step of a 1.7B-shaped model makes
// about 120 matmul calls, and five at::empty per call (and, for a long prefill, fresh pages from mmap each time)
// were time outside the weight stream (forward.cpp has the measurement). It grows to the largest call this thread
// has made (1.625 M K bytes: the peak the five at::empty reached) and lives as long as the thread.
Quantized workspace(int64_t M, int64_t K) {
  thread_local std::vector<uint8_t> ws;
  int64_t bytes[5];
  quantized_sizes(M, K, bytes);
  const size_t need = size_t(bytes[0] + bytes[1] + bytes[2] + bytes[3] + bytes[4] + 64);
  if (ws.size() < need) ws.resize(need);
  const auto base = reinterpret_cast<std::uintptr_t>(ws.data());
  return carve(reinterpret_cast<uint8_t*>((base + 63) & ~std::uintptr_t(63)), bytes);
}

// Rows are independent (each row's blocks alone, q8.h): threads split them, 4 rows at least (a decode step's
// 16 rows are two threads' work, not one's while the other waits).
void quantize(const at::Tensor& x, int use, const Quantized& q) {
  const int64_t M = x.size(0), K = x.size(1);
  const float* xp = x.data_ptr<float>();
  const int64_t stride = x.stride(0);
  steady_fp::parallel_for(0, M, 4, [&](int64_t m0, int64_t m1) {
    kBuilds[use].quantize_rows(xp, stride, K, m0, m1, q.xq, q.dx, q.sxd, q.sx, q.zx16);
  });
}

}  // namespace

at::Tensor q8pack(const at::Tensor& w, int64_t fmt, int64_t K) {
  PackedLayout lay;
  TORCH_CHECK(packed_layout(int32_t(fmt), &lay), "q8pack: GGML type ", fmt, " has no int8 packing");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), "q8pack: w must be contiguous (N, row_bytes) uint8");
  const int64_t N = w.size(0);
  TORCH_CHECK(N % kPanel == 0, "q8pack: N = ", N, " is not a multiple of ", kPanel);
  TORCH_CHECK(K > 0 && K % (lay.k_quant ? 256 : kBlock) == 0, "q8pack: K = ", K, " does not fit the format");
  steady_qmm::Layout gguf;
  TORCH_CHECK(steady_qmm::layout_of(int32_t(fmt), &gguf) && w.size(1) == K / gguf.block * gguf.bytes, "q8pack: w has ",
              w.size(1), " bytes per row, GGML type ", fmt, " stores K = ", K, " in ", K / gguf.block * gguf.bytes);
  int64_t bad_row = 0, bad_block = 0;  // MXFP4: no block may need a rounded scale (formats.h)
  TORCH_CHECK(fmt != steady_fmt::MXFP4 || mxfp4_packable(w.data_ptr<uint8_t>(), w.size(1), N, K, &bad_row, &bad_block),
              "q8pack: MXFP4 row ", bad_row, ", block ", bad_block, " has exponent ",
              int(w.data_ptr<uint8_t>()[bad_row * w.size(1) + 17 * bad_block]),
              ": its scale is no binary16, so the int8 family cannot hold it exactly (QWeight.pack keeps such a "
              "matrix on the float32 family)");
  const int64_t panel_bytes = K / kBlock / (lay.k_quant ? 8 : 1) * lay.record;
  at::Tensor out = at::empty({N, panel_bytes / kPanel}, w.options());
  const int64_t row_bytes = w.size(1);
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  steady_fp::parallel_for(0, N / kPanel, 8, [&](int64_t p0, int64_t p1) {
    pack(int32_t(fmt), src + p0 * kPanel * row_bytes, row_bytes, (p1 - p0) * kPanel, K, dst + p0 * panel_bytes);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> q8quantize(const at::Tensor& x, int64_t isa) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 && x.size(1) % kBlock == 0,
              "q8quantize: x must be (M, K) float32 with K a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), blocks = K / kBlock;
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar)), dx = at::empty({M, blocks}, x.options());
  at::Tensor sxd = at::empty({M, blocks}, x.options()), sx = at::empty({M, blocks}, x.options().dtype(at::kInt));
  at::Tensor zx16 = at::empty({M, 2 * blocks}, x.options().dtype(at::kInt));
  quantize(x, pick(isa), Quantized{xq.data_ptr<int8_t>(), dx.data_ptr<float>(), sxd.data_ptr<float>(),
                                   sx.data_ptr<int32_t>(), zx16.data_ptr<int32_t>()});
  return {xq, dx};
}

int64_t q8_isa() { return best_q8_isa(); }

namespace {

// One call's operands after the checks every packed matmul makes: the format, its layout and the shapes.
struct Call {
  int32_t fmt;
  PackedLayout lay;
  int64_t M, K, N;
  int use;  // the build (pick)
};

Call checked(const char* op, const at::Tensor& x, const at::Tensor& w, int64_t packed_fmt, const at::Tensor& y,
             int64_t col0, int64_t isa) {
  Call c{int32_t(packed_fmt - kPacked), {}, 0, 0, 0, 0};
  TORCH_CHECK(packed_layout(c.fmt, &c.lay), op, ": no int8 kernel for packed type ", packed_fmt);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, op, ": x must be (M, K) float32");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), op, ": w must be contiguous packed panels");
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.dim() == 2 && y.stride(1) == 1, op, ": y must be (M, >= N) float32");
  c.M = x.size(0), c.K = x.size(1), c.N = w.size(0);
  TORCH_CHECK(c.K > 0 && c.K % (c.lay.k_quant ? 256 : kBlock) == 0 && c.N % kPanel == 0 &&
                  w.size(1) * kPanel == c.K / kBlock / (c.lay.k_quant ? 8 : 1) * c.lay.record,
              op, ": K = ", c.K, " does not match the packed panels (", w.size(1), " bytes per row)");
  TORCH_CHECK(y.size(0) == c.M && col0 >= 0 && col0 + c.N <= y.size(1), op, ": y is too small");
  c.use = pick(isa);
  return c;
}

// Rows [M, 2M) of q: row m's rounding residual r_m = x_m - xq_m * dx_m, quantized as any row, for rows [m0, m1)
// of x, whose own rows [0, M) are quantized already. r is one IEEE multiply and one subtract per value, the same
// code for every build (this file is compiled once, with -ffp-contract=off); a non-finite block's dx is NaN, so
// its residual is too.
void quantize_residuals(const float* x, int64_t stride, int64_t M, int64_t K, int use, const Quantized& q, int64_t m0,
                        int64_t m1) {
  const int64_t blocks = K / kBlock;
  std::vector<float> r(size_t(K), 0.0f);
  for (int64_t m = m0; m < m1; ++m) {
    const float* xm = x + m * stride;
    const int8_t* xq = q.xq + m * K;
    const float* dx = q.dx + m * blocks;
    for (int64_t k = 0; k < K; ++k) r[size_t(k)] = xm[k] - float(xq[k]) * dx[k / kBlock];
    const int64_t i = M + m;
    kBuilds[use].quantize_rows(r.data(), K, K, 0, 1, q.xq + i * K, q.dx + i * blocks, q.sxd + i * blocks,
                               q.sx + i * blocks, q.zx16 + 2 * i * blocks);
  }
}

// y = x · Wᵀ for the quantized rows [0, c.M) of q: threads split the panels.
void run_panels(const Call& c, const Quantized& q, const at::Tensor& w, float* y, int64_t y_stride) {
  Q8Args base{c.fmt, c.lay, q.xq, q.dx, q.sxd, q.sx, q.zx16, c.M, c.K, w.data_ptr<uint8_t>(), y, y_stride, 0, 0,
              prefetch_plan()};
  steady_fp::parallel_for(0, c.N / kPanel, 1, [&](int64_t p0, int64_t p1) {
    Q8Args a = base;
    a.p_begin = p0;
    a.p_end = p1;
    kBuilds[c.use].matmul(a);
  });
}

}  // namespace

void matmul_packed(const at::Tensor& x, const at::Tensor& w, int64_t packed_fmt, at::Tensor& y, int64_t col0,
                   int64_t isa) {
  const Call c = checked("qmatmul_", x, w, packed_fmt, y, col0, isa);
  if (c.M == 0 || c.N == 0) return;
  const Quantized q = workspace(c.M, c.K);
  quantize(x, c.use, q);
  run_panels(c, q, w, y.data_ptr<float>() + col0, y.stride(0));
}

void q8matmul_residual_(const at::Tensor& x, const at::Tensor& w, int64_t packed_fmt, at::Tensor& y, int64_t col0,
                        double margin, int64_t max_panels, int64_t isa) {
  const Call c = checked("q8matmul_residual_", x, w, packed_fmt, y, col0, isa);
  TORCH_CHECK(margin >= 0.0, "q8matmul_residual_: margin must be >= 0 (inf: every panel), got ", margin);
  TORCH_CHECK(max_panels > 0, "q8matmul_residual_: max_panels must be > 0, got ", max_panels);
  if (c.M == 0 || c.N == 0) return;
  const Quantized q = workspace(2 * c.M, c.K);  // rows [0, M): x; [M, 2M): the residuals
  quantize(x, c.use, q);
  const float* xp = x.data_ptr<float>();
  steady_fp::parallel_for(0, c.M, 4, [&](int64_t m0, int64_t m1) {
    quantize_residuals(xp, x.stride(0), c.M, c.K, c.use, q, m0, m1);
  });
  float* yp = y.data_ptr<float>() + col0;
  const int64_t ys = y.stride(0);
  const int64_t panels = c.N / kPanel, blocks = c.K / kBlock, panel_bytes = w.size(1) * kPanel;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float mg = float(margin);
  // y = x_q · Wᵀ, every output, threads splitting the panels; each thread takes its range in runs of kTopsFloats
  // outputs and finds their panels' largest (q8_tops.h) right after, while they sit in its cache (the head's
  // outputs are megabytes: read again from memory, the scan cost as much as the corrections).
  // Each (row, panel)'s largest output, every entry written below: kept between calls up to kKeptTops floats (a
  // decode step's), fresh beyond (a scoring chunk's rows, which would otherwise hold tens of MiB for good).
  thread_local std::vector<float> kept;
  std::vector<float> fresh;
  std::vector<float>& tops_buffer = c.M * panels <= kKeptTops ? kept : fresh;
  if (tops_buffer.size() < size_t(c.M * panels)) tops_buffer.resize(size_t(c.M * panels));
  float* const tops = tops_buffer.data();
  const int64_t run = std::max<int64_t>(1, kTopsFloats / (c.M * kPanel));
  const Q8Args base{c.fmt, c.lay, q.xq, q.dx, q.sxd, q.sx, q.zx16, c.M, c.K, wp, yp, ys, 0, 0, prefetch_plan()};
  steady_fp::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t s0 = p0; s0 < p1; s0 += run) {
      Q8Args a = base;
      a.p_begin = s0;
      a.p_end = std::min(p1, s0 + run);
      kBuilds[c.use].matmul(a);
      kBuilds[c.use].panel_tops(yp, ys, c.M, a.p_begin, a.p_end, tops, panels);
    }
  });
  // The (row, panel) items the residual rows correct: each row's panels whose largest output is >= the row's
  // largest - margin (the row's largest: the largest of its panels', exact in any order), at most max_panels of
  // them: those with the largest outputs, a tie to the lower panel (a total order, so one set). The cap bounds a
  // step's cost where a row's logits are flat (many tokens near its top, each of them improbable). A few percent
  // of the panels per row, so each item is a call of its own, one row against one panel; taken panel by panel, so
  // the rows that share a panel (common tokens) find its weights in cache.
  std::vector<std::vector<int64_t>> near(size_t(c.M));  // row m's items, as p * M + m
  steady_fp::parallel_for(0, c.M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* t = tops + m * panels;
      float top = -INFINITY;
      for (int64_t p = 0; p < panels; ++p) top = t[p] > top ? t[p] : top;
      const float floor = top - mg;
      std::vector<int64_t>& mine = near[size_t(m)];
      for (int64_t p = 0; p < panels; ++p)
        if (t[p] >= floor) mine.push_back(p * c.M + m);
      if (int64_t(mine.size()) > max_panels) {
        const auto before = [&](int64_t a, int64_t b) {  // larger output first, then lower panel
          const int64_t pa = a / c.M, pb = b / c.M;
          return t[pa] > t[pb] || (t[pa] == t[pb] && pa < pb);
        };
        std::nth_element(mine.begin(), mine.begin() + max_panels, mine.end(), before);
        mine.resize(size_t(max_panels));
      }
    }
  });
  std::vector<int64_t> items;
  for (const std::vector<int64_t>& row : near) items.insert(items.end(), row.begin(), row.end());
  std::sort(items.begin(), items.end());
  steady_fp::parallel_for(0, int64_t(items.size()), 1, [&](int64_t i0, int64_t i1) {
    alignas(64) float r_out[kPanel];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t p = items[size_t(i)] / c.M, m = items[size_t(i)] % c.M, row = c.M + m;  // its residual row
      Q8Args r{c.fmt, c.lay, q.xq + row * c.K, q.dx + row * blocks, q.sxd + row * blocks, q.sx + row * blocks,
               q.zx16 + 2 * row * blocks, 1, c.K, wp + p * panel_bytes, r_out, kPanel, 0, 1, base.ahead};
      kBuilds[c.use].matmul(r);
      float* out = yp + m * ys + p * kPanel;
      for (int64_t l = 0; l < kPanel; ++l) out[l] = out[l] + r_out[l];  // y = y_x + y_r, one rounding
    }
  });
}

void matmul_packed_groups(const at::Tensor& x, const std::vector<at::Tensor>& ws, int64_t packed_fmt,
                          const std::vector<int64_t>& starts, at::Tensor& y) {
  const int32_t fmt = int32_t(packed_fmt - kPacked);
  PackedLayout lay;
  TORCH_CHECK(packed_layout(fmt, &lay), "matmul_packed_groups: no int8 kernel for packed type ", packed_fmt);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "matmul_packed_groups: x must be contiguous (P, K) float32");
  TORCH_CHECK(!ws.empty() && starts.size() == ws.size() + 1 && starts.front() == 0 && starts.back() == x.size(0),
              "matmul_packed_groups: one matrix per group, groups covering x's rows");
  const int64_t P = x.size(0), K = x.size(1), N = ws[0].size(0);
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.dim() == 2 && y.is_contiguous() && y.size(0) == P && y.size(1) == N,
              "matmul_packed_groups: y must be contiguous (P, N) float32");
  TORCH_CHECK(K > 0 && K % (lay.k_quant ? 256 : kBlock) == 0 && N % kPanel == 0, "matmul_packed_groups: K = ", K,
              ", N = ", N, " do not fit the format");
  for (size_t g = 0; g < ws.size(); ++g) {
    TORCH_CHECK(ws[g].scalar_type() == at::kByte && ws[g].dim() == 2 && ws[g].is_contiguous() && ws[g].size(0) == N &&
                    ws[g].size(1) * kPanel == K / kBlock / (lay.k_quant ? 8 : 1) * lay.record,
                "matmul_packed_groups: matrix ", g, " is not (N, K) in packed panels of the format");
    TORCH_CHECK(starts[g] <= starts[g + 1], "matmul_packed_groups: group starts must ascend");
  }
  const int use = pick(-1);
  if (P == 0) return;
  const Quantized q = workspace(P, K);
  quantize(x, use, q);  // each row's blocks alone: the values matmul_packed would quantize for that row
  const int64_t panels = N / kPanel, blocks = K / kBlock, G = int64_t(ws.size());
  const Prefetch ahead = prefetch_plan();
  float* yp = y.data_ptr<float>();
  // Items are (group, panel), group-major; a thread takes a run of them costing its share of the rows x panels
  // (a long prompt's experts have unequal row counts; a decode step's, one row each, split evenly)
  std::vector<int64_t> cost(size_t(G) + 1, 0);  // cost[g]: rows x panels of the groups before g
  for (int64_t g = 0; g < G; ++g) cost[size_t(g) + 1] = cost[size_t(g)] + (starts[size_t(g) + 1] - starts[size_t(g)]) * panels;
  const auto item_at = [&](int64_t c) {  // the first item whose cost starts at or after c
    if (c >= cost.back()) return G * panels;
    const int64_t g = int64_t(std::upper_bound(cost.begin(), cost.end(), c) - cost.begin()) - 1;
    const int64_t m = starts[size_t(g) + 1] - starts[size_t(g)];
    return g * panels + (c - cost[size_t(g)] + m - 1) / m;
  };
  const int64_t shares = std::max<int64_t>(1, at::get_num_threads());
  steady_fp::parallel_for(0, shares, 1, [&](int64_t s0, int64_t s1) {
    const int64_t i0 = item_at(cost.back() * s0 / shares), i1 = item_at(cost.back() * s1 / shares);
    for (int64_t g = i0 / panels; g * panels < i1; ++g) {
      const int64_t r0 = starts[size_t(g)], m = starts[size_t(g) + 1] - r0;
      if (m == 0) continue;
      Q8Args a{fmt, lay, q.xq + r0 * K, q.dx + r0 * blocks, q.sxd + r0 * blocks, q.sx + r0 * blocks,
               q.zx16 + r0 * 2 * blocks, m, K, ws[size_t(g)].data_ptr<uint8_t>(), yp + r0 * N, N,
               std::max(i0, g * panels) - g * panels, std::min(i1, (g + 1) * panels) - g * panels, ahead};
      kBuilds[use].matmul(a);
    }
  });
}

}  // namespace steady_q8_ops
