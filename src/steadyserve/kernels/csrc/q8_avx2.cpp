// The AVX2 build of the int8 family: a panel's 16 rows are two ymm registers (rows 0-7, 8-15), the integer
// sums formed by maddubs and madd (lanes_avx2.h). Compiled for AVX2 by the pragma below (never by a -march flag),
// called only where isa.h's best_int8() allows it (q8linear.cpp). Bits equal the scalar build's (q8.h).
#include <immintrin.h>

#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "half.h"
#include "q8.h"

#pragma GCC target("avx2,fma,f16c")

namespace steady_q8 {
namespace avx2 {
namespace {

#include "lanes_avx2.h"

// Activation rows per tile: 16 ymm registers hold fewer accumulators than AVX-512's 32.
constexpr int kMM = 4;

#include "q8_body.h"
#include "q8_quantize.h"  // (q8_body.h closed the anonymous namespace: these are the build's entry points)
#include "q8_tops.h"

}  // namespace avx2
}  // namespace steady_q8
