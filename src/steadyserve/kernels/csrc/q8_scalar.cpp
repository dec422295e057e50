// The scalar build of the int8 family: the reference. One output at a time, the integer sum as a
// plain loop, the float chain of q8.h with std::fmaf (exactly rounded on any CPU). The vector builds
// are held to its bits by tests/test_q8.py.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "q8.h"

namespace steady_q8 {
namespace scalar {
namespace {

// The stored integer of row r, value kk of a block's record (q8.h's layout, read back).
int32_t stored(const uint8_t* rec, const PackedLayout& lay, int r, int kk) {
  const int j = kk / 4, i = kk % 4;
  if (lay.bits == 8) return int8_t(rec[64 * j + 4 * r + i]);  // Q8_0: a signed byte
  int32_t u = j < 4 ? rec[64 * j + 4 * r + i] & 15 : rec[64 * (j - 4) + 4 * r + i] >> 4;
  if (lay.bits == 5) u |= ((rec[256 + 4 * r + i] >> j) & 1) << 4;
  if (lay.bits == 6) u |= ((rec[256 + 64 * (j / 4) + 4 * r + i] >> (2 * (j % 4))) & 3) << 4;
  return u;
}

// I_c of q8.h for row r of the panel and activation row m, block c.
int32_t block_dot(const Q8Args& a, const uint8_t* rec, int r, int64_t m, int64_t c) {
  const int8_t* q = a.xq + m * a.K + c * kBlock;
  int32_t lo = 0, hi = 0;
  for (int kk = 0; kk < 16; ++kk) lo += (stored(rec, a.lay, r, kk) - a.lay.zero) * q[kk];
  for (int kk = 16; kk < 32; ++kk) hi += (stored(rec, a.lay, r, kk) - a.lay.zero) * q[kk];
  if (!a.lay.sub_scales) return lo + hi;
  const int qbytes = 384 + 64;
  const int8_t* sc = reinterpret_cast<const int8_t*>(rec + qbytes);
  return int32_t(sc[r]) * lo + int32_t(sc[16 + r]) * hi;
}

}  // namespace

void matmul(const Q8Args& a) {
  const int64_t blocks = a.K / kBlock;
  const int qbytes = a.lay.bits == 8 ? 512 : a.lay.bits == 4 ? 256 : a.lay.bits == 5 ? 320 : 384;
  for (int64_t p = a.p_begin; p < a.p_end; ++p) {
    for (int64_t m = 0; m < a.M; ++m) {
      for (int r = 0; r < kPanel; ++r) {
        float acc = 0.0f;
        for (int64_t c = 0; c < blocks; ++c) {
          const uint8_t* rec = a.w + (p * blocks + c) * a.lay.record;
          float wa, wb;
          std::memcpy(&wa, rec + qbytes + 4 * r, sizeof wa);
          const float t = float(block_dot(a, rec, r, m, c)) * a.dx[m * blocks + c];
          acc = std::fmaf(wa, t, acc);
          if (a.lay.has_min) {
            std::memcpy(&wb, rec + qbytes + 64 + 4 * r, sizeof wb);
            acc = std::fmaf(wb, a.sxd[m * blocks + c], acc);
          }
        }
        a.y[m * a.y_stride + p * kPanel + r] = acc;
      }
    }
  }
}

}  // namespace scalar
}  // namespace steady_q8
