// The KV cache's storage formats (--kv-cache-dtype): how a float32 key or value is stored, and read back.
//
// Writing (kv_write.cpp) rounds each value once, from that token's own K/V row only, so what a token stores
// depends on nothing else in the batch:
//   fp32: the float itself.
//   f16:  IEEE binary16, round to nearest even (the rounding of F16C's vcvtps2ph and of torch's .half()).
//   bf16: the top 16 bits of the float, round to nearest even (torch's .bfloat16()).
//   q8_0: llama.cpp's q8_0 over 32 consecutive values of one token's head (block_q8_0, quantize_row_q8_0_ref):
//         amax = max |x|, d = amax / 127, id = d ? 1 / d : 0, q = roundf(x * id) (half away from zero),
//         d stored as f16. A block with a non-finite value stores d = NaN and q = 0: it reads back as NaN,
//         as the float32 cache would propagate it.
// Reading (paged_attention.cpp) turns a stored value back into the float it stands for, exactly: every f16 and
// bf16 value is a float, and q * d (|q| <= 127: 7 bits, d an f16: 11 bits) needs at most 18 of a float's 24,
// so the product is exact. The attention kernel then runs float32's reduction order on those floats, so its
// bits are a function of the stored values alone, the same in every build.
//
// Layouts, per (block, kv head), Bs tokens of head dim D:
//   fp32/f16/bf16: K (D, Bs), keys transposed; V (Bs, D).
//   q8_0 (int8 tensors): K (D + D/16, Bs) bytes: its first D * Bs bytes are the int8 values in quads of dims,
//         (D/4, Bs, 4): dims [4 a, 4 a + 4) of key j at bytes 4 (a * Bs + j) .. + 3 (k_q8_at), so one 64-byte load
//         holds 4 dims of 16 keys, the operand of an int8 dot-product instruction; then D/32 rows of Bs f16 scales
//         (little-endian uint16, scale of dims [32 c, 32 c + 32) of key j at index c * Bs + j); V (Bs, D + D/16):
//         each token's D int8 values, then its D/32 f16 scales. 34 bytes per 32 values, against 128 in float32.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "half.h"

namespace steady_kv {

enum Fmt : int { kF32 = 0, kF16 = 1, kBF16 = 2, kQ8 = 3 };

constexpr int64_t kQBlock = 32;  // q8_0 values per scale

// Bytes of one (block, kv head) region of K or V (the two have the same size).
inline int64_t head_bytes(int fmt, int64_t d, int64_t bs) {
  return fmt == kF32 ? 4 * d * bs : fmt == kQ8 ? (d + d / 16) * bs : 2 * d * bs;
}

// binary16 <-> float: half.h's conversions (exact one way, round to nearest even the other).
using steady_num::float_to_half;
using steady_num::half_to_float;

__attribute__((always_inline)) inline float bf16_to_f32(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);  // NaN, quiet
  return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

// Where dim dd of key j sits among a q8_0 K region's int8 values (Bs keys per block): quads of dims, key-major.
inline int64_t k_q8_at(int64_t dd, int64_t j, int64_t Bs) { return 4 * ((dd / 4) * Bs + j) + dd % 4; }

// One q8_0 block of 32 floats -> 32 int8 (q[0 .. 31]) and its scale d = amax / 127, as a float32 (returned): the
// rule above. A block with a non-finite value gives d = NaN and q = 0. The cache stores d as an f16
// (quantize_q8_0); the integer attention quantizes its queries by the same rule and keeps d as a float.
inline float quantize_q8_block(const float* x, int8_t* q) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t i = 0; i < kQBlock; ++i) {
    finite = finite && std::isfinite(x[i]);
    amax = std::fabs(x[i]) > amax ? std::fabs(x[i]) : amax;
  }
  if (!finite) {
    for (int64_t i = 0; i < kQBlock; ++i) q[i] = 0;
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float d = amax / 127.0f;
  // 1 / d overflows for d below 2^-128 (amax under about 3.7e-37), and x * inf converts to int8 as undefined
  // behaviour; such a d is 0 as an f16 anyway, so the block reads back as zeros whatever q holds: store 0s.
  const float inv = d != 0.0f ? 1.0f / d : 0.0f;
  const float id = inv <= FLT_MAX ? inv : 0.0f;
  for (int64_t i = 0; i < kQBlock; ++i) q[i] = int8_t(std::roundf(x[i] * id));
  return d;
}

// One q8_0 block as the cache stores it: 32 int8 in q and the f16 scale (returned; 0x7e00, a NaN, for a block with
// a non-finite value).
inline uint16_t quantize_q8_0(const float* x, int8_t* q) {
  const float d = quantize_q8_block(x, q);
  return std::isnan(d) ? uint16_t(0x7e00u) : float_to_half(d);
}

}  // namespace steady_kv
