// The per-row pieces of paged attention (paged_attention.cpp): the exponential, the exact conversions of
// stored K/V values to floats, the score chains and the softmax sums, each written once for every build.
//
// The reduction order they implement is the one at the top of paged_attention.cpp; here, per piece:
//   - score_keys: step 1, score = s_D * scale with s_{d+1} = fma(q[d], k[d], s_d), d ascending, per key;
//   - softmax_rows: steps 2-4, the max (exact in any order), exp_det16 (IEEE mul/add only), and the sum over 16
//     lanes (lane i: keys j % 16 == i in ascending j) closed by one fixed pairwise tree;
//   - k_row / v_row / halves16 / k_block_floats / v_block_floats: a stored f16, bf16 or q8_0 value becomes the
//     float it stands for exactly (kv_format.h), so no order is involved.
// Every lane runs the same IEEE operations on one element, so the vector width never changes a bit. Included by each
// build's translation unit after its target pragma (attention_scalar.cpp, _avx2.cpp, _avx512.cpp): everything here
// is in an anonymous namespace, so each unit compiles its own copy for its width and no two copies meet at link time.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include <immintrin.h>

#include "isa.h"
#include "kv_format.h"

namespace steady_attn {
namespace {

constexpr int kLanes = 16;  // accumulator lanes; part of the numerics, not a tuning knob

#define STEADY_INLINE __attribute__((always_inline)) inline  // inlined into its caller, so built for its ISA

// 16 float lanes as one value: GCC lowers it to one zmm, two ymm or four xmm registers
// in the respective build, with the same element-wise IEEE operations on each.
typedef float f16v __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint32_t u16v __attribute__((vector_size(64)));
typedef uint16_t h16v __attribute__((vector_size(32)));  // 16 binary16 bit patterns

// x[i] = exp(x[i] - m) for 16 lanes, in place, from IEEE add/sub/mul only (Cephes expf
// coefficients, ~1 ulp) for x - m <= 0; x - m < -87 gives 0, so a masked score (-inf)
// contributes an exact zero.
STEADY_INLINE void exp_det16(float* x, float m) {
  f16v in;
  std::memcpy(&in, x, sizeof in);
  in = in - m;
  const i16v low = in < -87.0f;  // all ones where in < -87
  const f16v xc = low ? f16v{} - 87.0f : in;
  const f16v n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // + 1.5 * 2^23 rounds to an integer
  const f16v r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  f16v p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const f16v y = (p * (r * r) + r) + 1.0f;
  const i16v bits = (__builtin_convertvector(n, i16v) + 127) << 23;  // 2^n
  f16v scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const f16v e = low ? f16v{} : y * scale;
  std::memcpy(x, &e, sizeof e);
}

// 16 binary16 values -> floats, exactly: kv_format.h's f16_to_f32 written on 16 lanes, so that every build
// vectorizes it (the scalar form ran f16 attention ~6x slower than float32's). Normal halves by moving bits,
// subnormal ones as m * 2^-24 (an exact product), infinities and NaNs (quieted) by bits.
STEADY_INLINE void halves16(const uint16_t* h, float* out) {
  h16v raw;
  std::memcpy(&raw, h, sizeof raw);
  const u16v x = __builtin_convertvector(raw, u16v);
  const u16v sign = (x & 0x8000u) << 16, e = (x >> 10) & 0x1fu, m = x & 0x3ffu;
  const u16v normal = sign | (((x & 0x7fffu) + (112u << 10)) << 13);
  const u16v special = sign | 0x7f800000u | (m << 13) | ((u16v)(m != 0u) & 0x400000u);
  const f16v subf = __builtin_convertvector((i16v)m, f16v) * 5.9604644775390625e-8f;
  u16v sub;
  std::memcpy(&sub, &subf, sizeof sub);
  const u16v bits = e == 0u ? (sub | sign) : (e == 31u ? special : normal);
  std::memcpy(out, &bits, sizeof bits);
}

// n binary16 values -> floats, exactly, for a whole stored block (k_block_floats, v_block_floats): F16C's
// vcvtph2ps (exact for every half, NaNs quieted as f16_to_f32 quiets them) where the CPU has it, else halves16.
// Not inlined into the builds' loops: an F16C intrinsic cannot be compiled into the baseline build, and
// GCC 12 scalarizes _Float16 vector conversions, which made the f16 cache slower to read than float32's. Every
// choice gives the same floats, so it is a speed choice only; tests/test_attention_kernel.py checks all 65536
// halves on each.
// `next` (or null): a region of at least 2 n bytes read after this one; line i of it is requested as line i of `h`
// is read, so the next block streams in while this one converts instead of in one burst that stalls the thread.
__attribute__((target("avx,f16c"))) inline void halves_f16c(const uint16_t* h, float* out, int64_t n,
                                                            const uint8_t* next) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {  // one 64-byte line of halves
    if (next != nullptr) __builtin_prefetch(next + 2 * i, 0, 2);
    for (int j = 0; j < 32; j += 8)
      _mm256_storeu_ps(out + i + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i + j))));
  }
  for (; i < n; ++i) out[i] = steady_kv::f16_to_f32(h[i]);
}

inline void halves_lanes(const uint16_t* h, float* out, int64_t n, const uint8_t* next) {
  int64_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    if (next != nullptr) __builtin_prefetch(next + 2 * i, 0, 2);
    halves16(h + i, out + i);
    halves16(h + i + kLanes, out + i + kLanes);
  }
  for (; i + kLanes <= n; i += kLanes) halves16(h + i, out + i);
  for (; i < n; ++i) out[i] = steady_kv::f16_to_f32(h[i]);
}

using HalvesFn = void (*)(const uint16_t*, float*, int64_t, const uint8_t*);

// isa 0: halves16 on 16 lanes; 1: F16C; -1: F16C where the CPU has it and STEADYSERVE_ISA allows AVX2 (isa.h).
inline HalvesFn halves_fn(int64_t isa = -1) { return (isa < 0 ? steady_isa::use_f16c() : isa >= 1) ? halves_f16c : halves_lanes; }

// x[i] = tanh(x[i] / cap) * cap for 16 lanes (Gemma 2's soft-capping), from IEEE operations only:
// tanh|t| = (1 - e) / (1 + e) with e = exp(-2|t|) <= 1, the sign restored exactly. Elementwise.
STEADY_INLINE void softcap16(float* x, float cap) {
  float t[kLanes], e[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    t[l] = x[l] / cap;
    e[l] = -2.0f * std::fabs(t[l]);
  }
  exp_det16(e, 0.0f);
  for (int l = 0; l < kLanes; ++l) {
    const float th = (1.0f - e[l]) / (1.0f + e[l]);
    x[l] = (t[l] < 0.0f ? -th : th) * cap;
  }
}

// Row dd of a K block region `kh` (D, Bs), keys [off, off + N), as floats: the stored floats themselves for
// float32, else converted exactly into `buf` (kv_format.h). `scales`: the N keys' q8_0 scales of dd's block.
template <int F, int N>
STEADY_INLINE const float* k_row(const uint8_t* kh, int64_t dd, int64_t off, int64_t Bs, const float* scales,
                                 float* buf) {
  using namespace steady_kv;
  if constexpr (F == kF32) {
    return reinterpret_cast<const float*>(kh) + dd * Bs + off;
  } else if constexpr (F == kQ8) {
    const int8_t* qv = reinterpret_cast<const int8_t*>(kh) + dd * Bs + off;
    for (int l = 0; l < N; ++l) buf[l] = float(qv[l]) * scales[l];
  } else if constexpr (F == kF16) {
    const uint16_t* hv = reinterpret_cast<const uint16_t*>(kh) + dd * Bs + off;
    for (int c = 0; c < N; c += kLanes) halves16(hv + c, buf + c);
  } else {
    const uint16_t* hv = reinterpret_cast<const uint16_t*>(kh) + dd * Bs + off;
    for (int l = 0; l < N; ++l) buf[l] = bf16_to_f32(hv[l]);
  }
  return buf;
}

// Scores of N consecutive keys of one block (N a multiple of 16) for G query heads:
// out[r * stride + i] = (sum over d ascending of q_r[d] * k_i[d]) * scale, or -inf for
// keys outside [first, p]. More keys per pass only means more independent chains.
// kh: the block's K region of this kv head, in format F; off: the first key's offset in the block.
template <int F, int G, int N>
STEADY_INLINE void score_keys(const float* qg, const uint8_t* kh, int64_t off, int64_t D, int64_t Bs, int64_t key0,
                              int64_t first, int64_t p, float scale, float softcap, float* out, int64_t stride) {
  float s[G][N] = {};
  float buf[N], scales[N];
  for (int64_t dd = 0; dd < D; ++dd) {
    if (F == steady_kv::kQ8 && dd % steady_kv::kQBlock == 0) {  // the keys' scales of dims [dd, dd + 32)
      const uint16_t* sc = reinterpret_cast<const uint16_t*>(kh + D * Bs) + (dd / steady_kv::kQBlock) * Bs + off;
      for (int c = 0; c < N; c += kLanes) halves16(sc + c, scales + c);
    }
    const float* kr = k_row<F, N>(kh, dd, off, Bs, scales, buf);
    for (int r = 0; r < G; ++r) {
      const float qv = qg[r * D + dd];
      for (int l = 0; l < N; ++l) s[r][l] = std::fmaf(qv, kr[l], s[r][l]);
    }
  }
  const float neg_inf = -std::numeric_limits<float>::infinity();
  if (softcap > 0.0f) {
    for (int r = 0; r < G; ++r) {
      for (int l = 0; l < N; ++l) s[r][l] = s[r][l] * scale;
      for (int c = 0; c < N; c += kLanes) softcap16(&s[r][c], softcap);
      for (int l = 0; l < N; ++l) {
        const int64_t j = key0 + l;
        out[r * stride + l] = (j >= first && j <= p) ? s[r][l] : neg_inf;
      }
    }
    return;
  }
  for (int r = 0; r < G; ++r)
    for (int l = 0; l < N; ++l) {
      const int64_t j = key0 + l;
      out[r * stride + l] = (j >= first && j <= p) ? s[r][l] * scale : neg_inf;
    }
}

// Values [d0, d0 + NV) of row `row` of a V block region `vh` (Bs, D), as floats (as k_row).
template <int F, int NV>
STEADY_INLINE const float* v_row(const uint8_t* vh, int64_t row, int64_t d0, int64_t D, float* buf) {
  using namespace steady_kv;
  if constexpr (F == kF32) {
    return reinterpret_cast<const float*>(vh) + row * D + d0;
  } else if constexpr (F == kQ8) {
    const int8_t* qv = reinterpret_cast<const int8_t*>(vh) + row * (D + D / 16);
    const uint16_t* sc = reinterpret_cast<const uint16_t*>(qv + D);
    for (int c = 0; c < NV; c += kLanes) {  // 16 dims share one scale: d0 and NV are multiples of 16
      const float d = f16_to_f32(sc[(d0 + c) / kQBlock]);
      for (int l = 0; l < kLanes; ++l) buf[c + l] = float(qv[d0 + c + l]) * d;
    }
  } else if constexpr (F == kF16) {
    const uint16_t* hv = reinterpret_cast<const uint16_t*>(vh) + row * D + d0;
    for (int c = 0; c < NV; c += kLanes) halves16(hv + c, buf + c);
  } else {
    const uint16_t* hv = reinterpret_cast<const uint16_t*>(vh) + row * D + d0;
    for (int l = 0; l < NV; ++l) buf[l] = bf16_to_f32(hv[l]);
  }
  return buf;
}

// Steps 2-4 for G score rows of `stride` floats, n_chunks 16-key chunks each: exponentials in place,
// total[r] = row r's sum. Shared by the untiled and the tiled loop, so both run the same operations.
template <int G>
STEADY_INLINE void softmax_rows(float* scores, int64_t stride, int64_t n_chunks, float* total) {
  for (int r = 0; r < G; ++r) {
    float* sr = scores + r * stride;
    // 2. Max (exact in any order), as 16 lanes.
    const f16v neg_inf = f16v{} - std::numeric_limits<float>::infinity();
    f16v mv = neg_inf;
    for (int64_t c = 0; c < n_chunks; ++c) {
      f16v x;
      std::memcpy(&x, sr + c * kLanes, sizeof x);
      mv = x > mv ? x : mv;
    }
    float mlane[kLanes];
    std::memcpy(mlane, &mv, sizeof mlane);
    float m = mlane[0];
    for (int l = 1; l < kLanes; ++l) m = mlane[l] > m ? mlane[l] : m;
    // 3-4. Exponentials in place (masked keys give exact zeros), summed in 16 lanes: lane l adds its keys in
    // ascending c. Written on the vector type, because GCC left the array form as 16 scalar adds per chunk (11% of
    // a 2k-token prefill's attention).
    f16v acc = {};
    for (int64_t c = 0; c < n_chunks; ++c) {
      exp_det16(sr + c * kLanes, m);
      f16v e;
      std::memcpy(&e, sr + c * kLanes, sizeof e);
      acc = acc + e;
    }
    float lane[kLanes];
    std::memcpy(lane, &acc, sizeof lane);
    float l8[8], l4[4], l2[2];
    for (int i = 0; i < 8; ++i) l8[i] = lane[2 * i] + lane[2 * i + 1];
    for (int i = 0; i < 4; ++i) l4[i] = l8[2 * i] + l8[2 * i + 1];
    for (int i = 0; i < 2; ++i) l2[i] = l4[2 * i] + l4[2 * i + 1];
    total[r] = l2[0] + l2[1];
  }
}

// A whole K block region `kh` (D, Bs) of format F as floats (D, Bs) in `out`, each value exactly as k_row
// reads it. Not called for float32, whose blocks are read in place.
template <int F>
STEADY_INLINE void k_block_floats(const uint8_t* kh, int64_t D, int64_t Bs, float* out, const uint8_t* next) {
  if constexpr (F == steady_kv::kF16) {  // (D, Bs) halves in a row: one conversion of the region
    halves_fn()(reinterpret_cast<const uint16_t*>(kh), out, D * Bs, next);
    return;
  }
  float scales[kLanes];
  for (int64_t off = 0; off < Bs; off += kLanes)
    for (int64_t dd = 0; dd < D; ++dd) {
      if (F == steady_kv::kQ8 && dd % steady_kv::kQBlock == 0) {
        const uint16_t* sc = reinterpret_cast<const uint16_t*>(kh + D * Bs) + (dd / steady_kv::kQBlock) * Bs + off;
        halves16(sc, scales);
      }
      k_row<F, kLanes>(kh, dd, off, Bs, scales, out + dd * Bs + off);
    }
}

// A whole V block region `vh` (Bs, D) of format F as floats (Bs, D) in `out`, each value exactly as v_row
// reads it.
template <int F>
STEADY_INLINE void v_block_floats(const uint8_t* vh, int64_t D, int64_t Bs, float* out, const uint8_t* next) {
  if constexpr (F == steady_kv::kF16) {  // (Bs, D) halves in a row
    halves_fn()(reinterpret_cast<const uint16_t*>(vh), out, D * Bs, next);
    return;
  }
  for (int64_t row = 0; row < Bs; ++row)
    for (int64_t d0 = 0; d0 < D; d0 += kLanes) v_row<F, kLanes>(vh, row, d0, D, out + row * D + d0);
}

}  // namespace
}  // namespace steady_attn
