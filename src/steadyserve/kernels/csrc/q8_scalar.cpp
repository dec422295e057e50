// The scalar build of the int8 family: the reference. One output at a time, the integer sum as a
// plain loop, the float chain of q8.h with std::fmaf (exactly rounded on any CPU); the activations'
// quantization is q8_quantize.h over plain arrays. The vector builds are held to its bits by tests/test_q8.py.
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "half.h"
#include "formats.h"
#include "q8.h"

namespace steady_q8 {
namespace scalar {
namespace {

#include "lanes_scalar.h"  // half_at, and the lanes q8_quantize.h is written over

// The stored integer of row r, value kk of a block's quant planes (q8.h's layout, read back).
int32_t stored(const uint8_t* q, const PackedLayout& lay, int r, int kk) {
  const int j = kk / 4, i = kk % 4;
  if (lay.bits == 8) return int8_t(q[64 * j + 4 * r + i]);  // Q8_0: a signed byte
  int32_t u = j < 4 ? q[64 * j + 4 * r + i] & 15 : q[64 * (j - 4) + 4 * r + i] >> 4;
  if (lay.bits == 5) u |= ((q[256 + 4 * r + i] >> j) & 1) << 4;
  if (lay.bits == 6) u |= ((q[256 + 64 * (j / 4) + 4 * r + i] >> (2 * (j % 4))) & 3) << 4;
  return lay.lut ? steady_fmt::kMxfp4Stored[u] : u;
}

// One block's constants for row r of a panel (q8.h: a, b and Q6_K's sub-scales from the scale fields).
struct Consts {
  float a = 0.0f, b = 0.0f;
  int32_t sc_lo = 1, sc_hi = 1;
};

Consts consts(const uint8_t* scales, const PackedLayout& lay, int r, int i) {
  Consts k;
  k.a = half_at(scales + 2 * r);
  if (lay.k_quant && lay.has_min) {  // Q4_K, Q5_K
    k.a = k.a * float(scales[steady_fmt::kScaleSc + 16 * i + r]);
    k.b = -(half_at(scales + steady_fmt::kScaleM + 2 * r) * float(scales[steady_fmt::kScaleMn + 16 * i + r]));
  } else if (lay.has_min) {  // Q4_1
    k.b = half_at(scales + steady_fmt::kScaleM + 2 * r);
  }
  if (lay.sub_scales) {  // Q6_K
    k.sc_lo = int8_t(scales[steady_fmt::kScaleSub + 16 * (2 * i) + r]);
    k.sc_hi = int8_t(scales[steady_fmt::kScaleSub + 16 * (2 * i + 1) + r]);
  }
  return k;
}

// I_c of q8.h for row r of the panel and activation row m, block c (quant planes q).
int32_t block_dot(const Q8Args& a, const uint8_t* q, const Consts& k, int r, int64_t m, int64_t c) {
  const int8_t* x = a.xq + m * a.K + c * kBlock;
  int32_t lo = 0, hi = 0;
  for (int kk = 0; kk < 16; ++kk) lo += (stored(q, a.lay, r, kk) - a.lay.zero) * x[kk];
  for (int kk = 16; kk < 32; ++kk) hi += (stored(q, a.lay, r, kk) - a.lay.zero) * x[kk];
  return a.lay.sub_scales ? k.sc_lo * lo + k.sc_hi * hi : lo + hi;
}

}  // namespace

void matmul(const Q8Args& a) {
  const int64_t blocks = a.K / kBlock;
  const int per = a.lay.k_quant ? 8 : 1;
  const int64_t records = blocks / per;
  for (int64_t p = a.p_begin; p < a.p_end; ++p) {
    for (int64_t m = 0; m < a.M; ++m) {
      for (int r = 0; r < kPanel; ++r) {
        float acc = 0.0f;
        for (int64_t c = 0; c < blocks; ++c) {
          const uint8_t* rec = a.w + (p * records + c / per) * a.lay.record;
          const int i = int(c % per);
          const Consts k = consts(rec + per * a.lay.qbytes, a.lay, r, i);
          const float t = float(block_dot(a, rec + i * a.lay.qbytes, k, r, m, c)) * a.dx[m * blocks + c];
          acc = std::fmaf(k.a, t, acc);
          if (a.lay.has_min) acc = std::fmaf(k.b, a.sxd[m * blocks + c], acc);
        }
        a.y[m * a.y_stride + p * kPanel + r] = acc;
      }
    }
  }
}

#include "q8_quantize.h"
#include "q8_tops.h"

}  // namespace scalar
}  // namespace steady_q8
