// The AVX-512 VNNI build of the int8 family: a panel's 16 rows are the 16 lanes of one zmm register and
// vpdpbusd forms the integer sums. Compiled for AVX-512 VNNI by the pragma below (never by a -march flag),
// called only where CPUID reports avx512f/bw/dq/vl and avx512_vnni (q8linear.cpp). Bits equal the scalar
// build's (q8.h).
#include <immintrin.h>

#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "q8.h"

#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")

namespace steady_q8 {
namespace avx512 {
namespace {

#include "q8_avx512_lanes.h"

#include "q8_body.h"

namespace {  // the activation quantization's lanes

using QF = __m512;
inline QF qload(const float* p) { return _mm512_loadu_ps(p); }
inline bool qall_finite(QF v) { return _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(FLT_MAX), _CMP_LE_OQ) == 0xFFFF; }
inline float qhmax_abs(QF a, QF b) { return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b))); }
inline int32_t qround_store(QF v, float s, int8_t* q) {  // q = round-half-even(v * s); returns their sum
  const __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(s)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(i));
  return _mm512_reduce_add_epi32(i);
}

}  // namespace

#include "q8_quantize.h"

}  // namespace avx512
}  // namespace steady_q8
