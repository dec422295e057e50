// The AVX2 build of the matmul family: qmm_body.h over lanes_avx2.h (16 lanes, two ymm registers) with its tile
// sizes. Compiled for AVX2 + FMA + F16C by the pragma below (never by a -march flag), called only where isa.h's
// best_float() allows it (qlinear.cpp). Bits equal the scalar build's (qmm.h).
#include <immintrin.h>

#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "half.h"
#include "qmm.h"

#pragma GCC target("avx2,fma,f16c")

namespace steady_qmm {
namespace avx2 {
namespace {

#include "lanes_avx2.h"

// 16 ymm registers, two per F: smaller tiles than AVX-512. Rows up to which weights are dequantized in
// registers, and weight rows per register tile for MM rows (2 rows: 8 + 8 ymm; 3-4 rows: 8 + 4, plus x).
constexpr int kSmallM = 4;
constexpr int fused_nr(int mm) { return mm <= 2 ? 2 : 1; }
constexpr int kMR = 2;
constexpr int kNR = 2;
constexpr int64_t kMB = 96;  // rows per pass over a dequantized panel
constexpr int64_t kPrefetchTiles = 4;  // small-M weight tiles read ahead of the one being multiplied

#include "qmm_body.h"

}  // namespace avx2
}  // namespace steady_qmm
