// The AVX2 build of the matmul family: the 16 lanes are two ymm registers (lanes 0-7, 8-15).
// Compiled for AVX2 + FMA + F16C by the pragma below (never by a -march flag), called only
// where CPUID reports them (qlinear.cpp). Bits equal the scalar build's (qmm.h).
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "half.h"
#include "qmm.h"

#pragma GCC target("avx2,fma,f16c")

namespace steady_qmm {
namespace avx2 {
namespace {

struct F {
  __m256 a, b;  // lanes 0-7, 8-15
};
struct I {
  __m256i a, b;
};

// 16 ymm registers, two per F: smaller tiles than AVX-512. Rows up to which weights are dequantized in
// registers, and weight rows per register tile for MM rows (2 rows: 8 + 8 ymm; 3-4 rows: 8 + 4, plus x).
constexpr int kSmallM = 4;
constexpr int fused_nr(int mm) { return mm <= 2 ? 2 : 1; }
constexpr int kMR = 2;
constexpr int kNR = 2;
constexpr int64_t kMB = 96;
constexpr int64_t kPrefetchTiles = 4;  // small-M weight tiles read ahead of the one being multiplied
inline void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

inline F fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F fset1(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline F fload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void fstore(float* p, F v) { _mm256_storeu_ps(p, v.a); _mm256_storeu_ps(p + 8, v.b); }
inline F ffma(F x, F y, F z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
inline F fmul(F x, F y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
inline F fadd(F x, F y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
inline F fsub(F x, F y) { return {_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)}; }
inline F fdiv(F x, F y) { return {_mm256_div_ps(x.a, y.a), _mm256_div_ps(x.b, y.b)}; }
inline F fmax(F x, F y) { return {_mm256_max_ps(x.a, y.a), _mm256_max_ps(x.b, y.b)}; }
inline F fmin(F x, F y) { return {_mm256_min_ps(x.a, y.a), _mm256_min_ps(x.b, y.b)}; }
// The fixed tree of qmm.h: lanes i + 8 (the two registers), then + 4, + 2, + 1.
inline float hsum(F v) {
  const __m256 s8 = _mm256_add_ps(v.a, v.b);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
inline void hsum4(F a, F b, F c, F d, float* out) {  // four of hsum's trees
  out[0] = hsum(a), out[1] = hsum(b), out[2] = hsum(c), out[3] = hsum(d);
}
inline float hmax(F v) {
  const __m256 m8 = _mm256_max_ps(v.a, v.b);
  const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
}
inline uint32_t fmask_eq(F x, F y) {  // lane i -> bit i
  return uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(x.a, y.a, _CMP_EQ_OQ))) |
         uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(x.b, y.b, _CMP_EQ_OQ))) << 8;
}
inline uint32_t fmask_nan(F x) {
  return uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(x.a, x.a, _CMP_UNORD_Q))) |
         uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(x.b, x.b, _CMP_UNORD_Q))) << 8;
}
inline I iset1(int32_t v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
inline I ilanes() { return {_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)}; }
inline __m128i load8(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
inline I iload_u8(const uint8_t* p) { return {_mm256_cvtepu8_epi32(load8(p)), _mm256_cvtepu8_epi32(load8(p + 8))}; }
inline I iload_i8(const uint8_t* p) { return {_mm256_cvtepi8_epi32(load8(p)), _mm256_cvtepi8_epi32(load8(p + 8))}; }
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline I iload_u16(const uint8_t* p) { return {_mm256_cvtepu16_epi32(load16(p)), _mm256_cvtepu16_epi32(load16(p + 16))}; }
inline I iand(I x, int32_t m) { const __m256i k = _mm256_set1_epi32(m); return {_mm256_and_si256(x.a, k), _mm256_and_si256(x.b, k)}; }
inline I isrl(I x, int n) { return {_mm256_srli_epi32(x.a, n), _mm256_srli_epi32(x.b, n)}; }
inline I isll(I x, int n) { return {_mm256_slli_epi32(x.a, n), _mm256_slli_epi32(x.b, n)}; }
inline I isrlv(I x, I n) { return {_mm256_srlv_epi32(x.a, n.a), _mm256_srlv_epi32(x.b, n.b)}; }
inline I ior(I x, I y) { return {_mm256_or_si256(x.a, y.a), _mm256_or_si256(x.b, y.b)}; }
inline I isub(I x, I y) { return {_mm256_sub_epi32(x.a, y.a), _mm256_sub_epi32(x.b, y.b)}; }
inline I iadd(I x, I y) { return {_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)}; }
inline F i2f(I x) { return {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
inline I f2i(F x) { return {_mm256_cvttps_epi32(x.a), _mm256_cvttps_epi32(x.b)}; }
inline F ibits2f(I x) { return {_mm256_castsi256_ps(x.a), _mm256_castsi256_ps(x.b)}; }
// F16C's scalar conversion: exact, so the same value as the scalar build's software conversion.
inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return _cvtsh_ss(h);
}
inline F h2f(const uint8_t* p) { return {_mm256_cvtph_ps(load16(p)), _mm256_cvtph_ps(load16(p + 16))}; }

#include "qmm_body.h"

}  // namespace avx2
}  // namespace steady_qmm
