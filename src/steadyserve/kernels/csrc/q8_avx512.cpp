// The AVX-512 VNNI build of the int8 family: a panel's 16 rows are the 16 lanes of one zmm register and
// vpdpbusd forms the integer sums (lanes_avx512.h). Compiled for AVX-512 VNNI by the pragma below (never by a
// -march flag), called only where isa.h's best_int8() allows it (q8linear.cpp). Bits equal the scalar build's (q8.h).
#include <immintrin.h>

#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "half.h"
#include "q8.h"

#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,avx512vnni")

namespace steady_q8 {
namespace avx512 {
namespace {

#include "lanes_avx512.h"

// Activation rows per tile: 8 accumulators, 8 weight operands and the block's constants fit in 32 zmm.
constexpr int kMM = 8;

#include "q8_body.h"
#include "q8_quantize.h"  // (q8_body.h closed the anonymous namespace: these are the build's entry points)
#include "q8_tops.h"

}  // namespace avx512
}  // namespace steady_q8
