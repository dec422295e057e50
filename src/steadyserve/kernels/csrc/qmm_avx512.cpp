// The AVX-512 build of the matmul family: the 16 lanes are one zmm register.
// Compiled for AVX-512 by the pragma below (never by a -march flag), called only where
// CPUID reports avx512f/bw/dq/vl (qlinear.cpp). Bits equal the scalar build's (qmm.h).
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "half.h"
#include "qmm.h"

#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")

namespace steady_qmm {
namespace avx512 {
namespace {

using F = __m512;
using I = __m512i;

// Rows up to which weights are dequantized in registers: each weight is dequantized once for all of them.
// 8 lets one verification pass of speculative decoding (1 + up to 7 draft tokens) cost about as much as a
// few decode steps (engine/speculation.py).
constexpr int kSmallM = 8;
// Weight rows per register tile there, for MM rows: MM * NN accumulators + 2 NN weight vectors + 2 of x
// stay within the 32 zmm registers (4 rows: 16 + 8 + 2; 8 rows: 16 + 4 + 2).
constexpr int fused_nr(int mm) { return mm <= 4 ? 4 : 2; }
constexpr int kMR = 4;       // rows x weight rows of the panel tile: 16 zmm accumulators
constexpr int kNR = 4;
constexpr int64_t kMB = 96;
constexpr int64_t kPrefetchTiles = 4;  // small-M weight tiles read ahead of the one being multiplied
inline void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }  // rows per pass over a dequantized panel

inline F fzero() { return _mm512_setzero_ps(); }
inline F fset1(float v) { return _mm512_set1_ps(v); }
inline F fload(const float* p) { return _mm512_loadu_ps(p); }
inline void fstore(float* p, F v) { _mm512_storeu_ps(p, v); }
inline F ffma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
inline F fmul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F fadd(F a, F b) { return _mm512_add_ps(a, b); }
inline F fsub(F a, F b) { return _mm512_sub_ps(a, b); }
inline F fdiv(F a, F b) { return _mm512_div_ps(a, b); }
inline F fmax(F a, F b) { return _mm512_max_ps(a, b); }
inline F fmin(F a, F b) { return _mm512_min_ps(a, b); }
// The fixed tree of qmm.h: lanes i + 8, then + 4, + 2, + 1.
inline float hsum(F v) {
  const __m256 lo = _mm512_castps512_ps256(v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  const __m256 s8 = _mm256_add_ps(lo, hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
// Four sums at once, each with exactly hsum's tree (the same additions, packed four outputs to a register).
inline void hsum4(F a, F b, F c, F d, float* out) {
  const F ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));  // l_i + l_{i+8}
  const F cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  const F q = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));  // + 4
  const F r = _mm512_add_ps(q, _mm512_permute_ps(q, 0x4E));  // + 2 (lanes 0, 1 of each 128-bit chunk)
  const F t = _mm512_add_ps(r, _mm512_permute_ps(r, 0xB1));  // + 1 (lane 0 of each chunk)
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, t);
  out[0] = lanes[0], out[1] = lanes[4], out[2] = lanes[8], out[3] = lanes[12];
}
inline float hmax(F v) { return _mm512_reduce_max_ps(v); }  // exact in any order
inline uint32_t fmask_eq(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }  // lane i -> bit i
inline uint32_t fmask_nan(F a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
inline I iset1(int32_t v) { return _mm512_set1_epi32(v); }
inline I ilanes() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
inline I iload_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline I iload_i8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline I iload_u16(const uint8_t* p) { return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline I iand(I a, int32_t m) { return _mm512_and_si512(a, _mm512_set1_epi32(m)); }
inline I isrl(I a, int n) { return _mm512_srli_epi32(a, n); }
inline I isll(I a, int n) { return _mm512_slli_epi32(a, n); }
inline I isrlv(I a, I n) { return _mm512_srlv_epi32(a, n); }
inline I ior(I a, I b) { return _mm512_or_si512(a, b); }
inline I isub(I a, I b) { return _mm512_sub_epi32(a, b); }
inline I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
inline F i2f(I a) { return _mm512_cvtepi32_ps(a); }
inline I f2i(F a) { return _mm512_cvttps_epi32(a); }
inline F ibits2f(I a) { return _mm512_castsi512_ps(a); }
// F16C's scalar conversion: exact, so the same value as the scalar build's software conversion.
inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return _cvtsh_ss(h);
}
inline F h2f(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

#include "qmm_body.h"

}  // namespace avx512
}  // namespace steady_qmm
