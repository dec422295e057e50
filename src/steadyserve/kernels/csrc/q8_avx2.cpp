// The AVX2 build of the int8 family: a panel's 16 rows are two ymm registers (rows 0-7, 8-15), the integer
// sums formed by maddubs (unsigned weight x signed activation byte pairs into int16) and madd (int16 pairs
// into int32). Nothing saturates: the bounds are in q8_pack.cpp; Q8_0's signed weights use the sign trick
// (|w| times x with w's sign). Compiled for AVX2 by the pragma below (never by a -march flag), called only
// where CPUID reports avx2, fma and f16c (q8linear.cpp). Bits equal the scalar build's (q8.h).
#include <immintrin.h>

#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "q8.h"

#pragma GCC target("avx2,fma,f16c")

namespace steady_q8 {
namespace avx2 {
namespace {

struct W {
  __m256i a, b;  // panel rows 0-7, 8-15: 4 bytes each
};
struct I {
  __m256i a, b;
};
struct F {
  __m256 a, b;
};

// Activation rows per tile: 16 ymm registers hold fewer accumulators than AVX-512's 32.
constexpr int kMM = 4;
constexpr int32_t kSignedBias = 0;  // the sign trick forms sum w x directly

inline __m256i bytes(int m) { return _mm256_set1_epi8(char(m)); }
inline W wload(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline W wand(W w, int m) { return {_mm256_and_si256(w.a, bytes(m)), _mm256_and_si256(w.b, bytes(m))}; }
inline W wsrl16(W w, int n) { return {_mm256_srli_epi16(w.a, n), _mm256_srli_epi16(w.b, n)}; }
inline W wsll16(W w, int n) { return {_mm256_slli_epi16(w.a, n), _mm256_slli_epi16(w.b, n)}; }
inline W wor(W x, W y) { return {_mm256_or_si256(x.a, y.a), _mm256_or_si256(x.b, y.b)}; }
inline I izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
// Partial sums in int16 lanes (two per panel row): maddubs adds each pair of u8 x s8 products into one, and up to
// kSumRun<BITS> quads' maddubs results add up in int16 before one madd (by ones) widens them to int32. maddubs and
// madd both run on the vector multiplier (one port on AMD Zen 1 and 2), so widening once per run, not once per quad,
// nearly halves that port's work for 4-bit weights. Bounds (|x| <= 127): a pair sum is at most 2 * (2^BITS - 1) * 127:
// 3810, 7874, 16002 for 4, 5, 6 bits, so 8, 4, 2 of them: 30480, 31496, 32004 <= 32767; Q8_0 through the sign trick
// (|w| <= 128): 2 * 128 * 127 = 32512, one. Nothing saturates (maddubs's own pair sums included), so every sum is
// exact and its grouping changes no value.
struct S {
  __m256i a, b;  // int16 lanes: panel rows 0-7, 8-15, two lanes per row
};
template <int BITS>
constexpr int kSumRun = BITS == 4 ? 8 : BITS == 5 ? 4 : BITS == 6 ? 2 : 1;
inline S szero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
// One vpaddw that GCC cannot reassociate. Written as +, a run of 8 quads' sums over a tile's 4 rows becomes a tree
// whose 64 products are spilled to the stack first (16 ymm registers), and a ymm store costs Zen 1 two cycles: the
// 4-bit tile ran 12% faster in sequence (AMD EPYC Zen 1, one core, a 1024 x 2048 Q4_K matrix at M = 4 and 16). Q6_K's
// runs of 2 were 12% slower that way, so they keep the + (integer sums: either way the same value).
inline __m256i add16_in_order(__m256i a, __m256i b) {
  __m256i r;
  asm("vpaddw %2, %1, %0" : "=x"(r) : "x"(a), "xm"(b));
  return r;
}
template <int BITS>
inline __m256i add16(__m256i a, __m256i b) {
  if constexpr (kSumRun<BITS> >= 4) return add16_in_order(a, b);
  return _mm256_add_epi16(a, b);
}
template <int BITS>
inline S sdot(S s, W w, int32_t x4) {
  const __m256i x = _mm256_set1_epi32(x4);
  return {add16<BITS>(s.a, _mm256_maddubs_epi16(w.a, x)), add16<BITS>(s.b, _mm256_maddubs_epi16(w.b, x))};
}
inline S sdot_signed(S s, W w, int32_t x4) {
  const __m256i x = _mm256_set1_epi32(x4);
  return {_mm256_add_epi16(s.a, _mm256_maddubs_epi16(_mm256_abs_epi8(w.a), _mm256_sign_epi8(x, w.a))),
          _mm256_add_epi16(s.b, _mm256_maddubs_epi16(_mm256_abs_epi8(w.b), _mm256_sign_epi8(x, w.b)))};
}
inline I widen(I acc, S s) {
  const __m256i ones = _mm256_set1_epi16(1);
  return {_mm256_add_epi32(acc.a, _mm256_madd_epi16(s.a, ones)), _mm256_add_epi32(acc.b, _mm256_madd_epi16(s.b, ones))};
}
inline I isub_bcast(I x, int32_t v) {
  const __m256i s = _mm256_set1_epi32(v);
  return {_mm256_sub_epi32(x.a, s), _mm256_sub_epi32(x.b, s)};
}
inline I i8load(const uint8_t* p) {
  return {_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline F f_of_i(I x) { return {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
inline F fmul_bcast(F x, float s) {
  const __m256 v = _mm256_set1_ps(s);
  return {_mm256_mul_ps(x.a, v), _mm256_mul_ps(x.b, v)};
}
inline F fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F fmul(F x, F y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
inline F fneg(F x) {
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN));
  return {_mm256_xor_ps(x.a, sign), _mm256_xor_ps(x.b, sign)};
}
inline F h2f16(const uint8_t* p) {  // exact, as half.h's conversion
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline F u8f(const uint8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))))};
}
inline F ffma(F x, F y, F z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
inline F ffma_bcast(F x, float s, F z) {
  const __m256 v = _mm256_set1_ps(s);
  return {_mm256_fmadd_ps(x.a, v, z.a), _mm256_fmadd_ps(x.b, v, z.b)};
}
inline void fstore(float* p, F v) {
  _mm256_storeu_ps(p, v.a);
  _mm256_storeu_ps(p + 8, v.b);
}

#include "q8_body.h"

namespace {  // the activation quantization's lanes: two ymm per 16 values

struct QF {
  __m256 a, b;
};
inline QF qload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 qabs(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }
inline bool qall_finite(QF v) {
  const __m256 lim = _mm256_set1_ps(FLT_MAX);
  return _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(qabs(v.a), lim, _CMP_LE_OQ),
                                          _mm256_cmp_ps(qabs(v.b), lim, _CMP_LE_OQ))) == 0xFF;
}
inline float qhmax_abs(QF x, QF y) {  // a max is exact in any order
  alignas(32) float l[8];
  _mm256_store_ps(l, _mm256_max_ps(_mm256_max_ps(qabs(x.a), qabs(x.b)), _mm256_max_ps(qabs(y.a), qabs(y.b))));
  float m = l[0];
  for (int i = 1; i < 8; ++i) m = l[i] > m ? l[i] : m;
  return m;
}
inline int32_t qround_store(QF v, float s, int8_t* q) {  // q = round-half-even(v * s); returns their sum
  const __m256 sv = _mm256_set1_ps(s);
  const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(v.a, sv)), b = _mm256_cvtps_epi32(_mm256_mul_ps(v.b, sv));
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);  // 16 int16 in order
  const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), bytes);
  alignas(32) int32_t l[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(l), _mm256_add_epi32(a, b));
  int32_t sum = 0;
  for (int i = 0; i < 8; ++i) sum += l[i];
  return sum;
}

}  // namespace

#include "q8_quantize.h"

}  // namespace avx2
}  // namespace steady_q8
