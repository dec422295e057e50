// The AVX-512 build of the matmul family: qmm_body.h over lanes_avx512.h (16 lanes, one zmm register) with its tile
// sizes. Compiled for AVX-512 by the pragma below (never by a -march flag), called only where isa.h's best_float()
// allows it (qlinear.cpp). Bits equal the scalar build's (qmm.h).
#include <immintrin.h>

#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "half.h"
#include "qmm.h"

#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")

namespace steady_qmm {
namespace avx512 {
namespace {

#include "lanes_avx512.h"

// Rows up to which weights are dequantized in registers: each weight is dequantized once for all of them.
// 8 lets one verification pass of speculative decoding (1 + up to 7 draft tokens) cost about as much as a
// few decode steps (engine/speculation.py).
constexpr int kSmallM = 8;
// Weight rows per register tile there, for MM rows: MM * NN accumulators + 2 NN weight vectors + 2 of x
// stay within the 32 zmm registers (4 rows: 16 + 8 + 2; 8 rows: 16 + 4 + 2).
constexpr int fused_nr(int mm) { return mm <= 4 ? 4 : 2; }
constexpr int kMR = 4;       // rows x weight rows of the panel tile: 16 zmm accumulators
constexpr int kNR = 4;
constexpr int64_t kMB = 96;  // rows per pass over a dequantized panel
constexpr int64_t kPrefetchTiles = 4;  // small-M weight tiles read ahead of the one being multiplied

#include "qmm_body.h"

}  // namespace avx512
}  // namespace steady_qmm
