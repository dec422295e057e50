// The native matmul family's interface: y = x · Wᵀ with W in its stored GGUF block format.
//
// THE REDUCTION ORDER (the numerics of every kernel in this family; see qmm_body.h):
//   For one output y[m, n] over K inputs (K a multiple of 32):
//     1. w[k] is the weight's dequantized fp32 value, computed with gguf-py's own IEEE
//        operations for its format (so it equals gguf-py's dequantizer bitwise).
//     2. 16 accumulator lanes start at +0. Lane j accumulates the k with k % 16 == j, in
//        ascending k, one fused multiply-add each: acc_j = fma(x[m, k], w[k], acc_j).
//     3. The lanes are summed in one fixed tree: s8_i = l_i + l_{i+8}, s4_i = s8_i + s8_{i+4},
//        s2_i = s4_i + s4_{i+2}, y = s2_0 + s2_1.
//   Nothing in it depends on M (the rows in the call), on how threads split the work
//   (threads split N, never K), or on the ISA: the scalar build runs the same 16 lanes with
//   std::fmaf, AVX2 holds them in two ymm registers and AVX-512 in one zmm register, and all
//   three combine them with the same tree. A row's bits are therefore the same whatever
//   else is in its batch, by construction. The row-wise ops (RMSNorm, SiLU·mul,
//   log-softmax) follow the same 16-lane rule for their sums.
//
// The three builds are three translation units (qmm_scalar.cpp, qmm_avx2.cpp,
// qmm_avx512.cpp) compiling the one body with a different lane type; qlinear.cpp picks
// one by CPUID at run time. No -ffast-math, no -march: -ffp-contract=off keeps the
// compiler from fusing any multiply and add the source does not fuse itself.
#pragma once

#include <cstdint>

#include "formats.h"

namespace steady_qmm {

using namespace steady_fmt::ids;  // the GGML type ids (formats.h)

// Bytes that hold `block` consecutive weights of one row, per format (formats.h's traits).
struct Layout {
  int32_t block;  // weights per block
  int32_t bytes;  // bytes per block
};

inline bool layout_of(int32_t fmt, Layout* out) {
  const steady_fmt::Traits* t = steady_fmt::traits(fmt);
  if (t) *out = {t->block, t->bytes};
  return t != nullptr;
}

// One matmul call's operands, for the panel range [n_begin, n_end) of one thread.
struct MatmulArgs {
  int32_t fmt;
  const float* x;      // (M, K), row stride x_stride floats
  int64_t x_stride;
  int64_t M, K;
  const uint8_t* w;    // (N, row_bytes): row n holds the K weights of output column n
  int64_t row_bytes;
  float* y;            // (M, >= n_end), row stride y_stride floats
  int64_t y_stride;
  int64_t n_begin, n_end;
  float* scratch;      // at least kScratchRows * K floats, owned by the calling thread
};

constexpr int64_t kScratchRows = 8;  // dequantized weight rows a thread keeps at once (the widest panel)

// The entry points each build provides (same names in namespaces scalar, avx2, avx512).
#define STEADY_QMM_DECLARE(ns)                                                                       \
  namespace ns {                                                                                     \
  void matmul(const MatmulArgs& a);                                                                  \
  /* the most rows matmul multiplies with weights dequantized in registers (kSmallM) */              \
  int64_t register_rows();                                                                           \
  /* out[i, :] = the dequantized weights of row rows[i] (K floats each) */                           \
  void dequant_rows(int32_t fmt, const uint8_t* w, int64_t row_bytes, int64_t K, const int64_t* rows, \
                    int64_t num_rows, float* out);                                                   \
  /* y[t] = (x[t] * (1 / sqrt(mean(x[t]^2) + eps))) * weight, rows [t0, t1) */                       \
  void rms_norm(const float* x, int64_t x_stride, const float* weight, float eps, int64_t D, float* y,  \
                int64_t t0, int64_t t1);                                                             \
  /* y[t, i] = silu(g[t, i]) * u[t, i] with g = gu[t, :I], u = gu[t, I:], rows [t0, t1) */           \
  void silu_mul(const float* gu, int64_t I, float* y, int64_t t0, int64_t t1);                     \
  /* y[t, i] = gelu_tanh(g[t, i]) * u[t, i], the same halves as silu_mul, rows [t0, t1) */         \
  void gelu_tanh_mul(const float* gu, int64_t I, float* y, int64_t t0, int64_t t1);                \
  /* y[t, i] = (clamp(u, -limit, limit) + 1) * swish_alpha(min(g, limit)), gpt-oss's, the same halves */ \
  void swiglu_oai_mul(const float* gu, int64_t I, float* y, int64_t t0, int64_t t1, float alpha, float limit); \
  /* y[t] = (x[t] - max) - log(sum exp(x[t] - max)), rows [t0, t1); y may be x (each y[k] is written after */ \
  /* the row's max and sum were read, from x[k] alone) */                                                  \
  void log_softmax(const float* x, int64_t V, float* y, int64_t t0, int64_t t1);                     \
  /* out[t] = the index of row t's first NaN if it has one, else of its first maximum (NumPy's argmax), */ \
  /* rows [t0, t1): comparisons only, so exact */                                                        \
  void argmax(const float* x, int64_t V, int64_t* out, int64_t t0, int64_t t1);                        \
  }

STEADY_QMM_DECLARE(scalar)
STEADY_QMM_DECLARE(avx2)
STEADY_QMM_DECLARE(avx512)

}  // namespace steady_qmm
