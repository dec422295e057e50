// IEEE binary16 <-> binary32 in portable C++: the one owner of these conversions. Every half is exactly a float, so
// half_to_float equals F16C's vcvtph2ps bit for bit (NaNs come out quiet, as vcvtph2ps quiets them); float_to_half
// rounds to nearest even like vcvtps2ph with its round-to-nearest immediate, except that every NaN becomes the one
// quiet NaN 0x7e00 (vcvtps2ph keeps the top of the payload): callers that use F16C send a NaN through here instead.
// Used by the scalar lanes (lanes_scalar.h), the KV cache's formats (kv_format.h) and the int8 packing (q8_pack.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace steady_num {

// Integer operations, selects and one exact multiply (no loop, no branch: it vectorizes). A subnormal half is
// m * 2^-24, a normal float (exact; MXCSR is pinned by fp_env.h, so no DAZ/FTZ can touch it).
__attribute__((always_inline)) inline float half_to_float(uint16_t h16) {
  const uint32_t h = h16, sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  const uint32_t normal = sign | (((h & 0x7fffu) + (112u << 10)) << 13);
  const uint32_t special = sign | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0u);
  const float sub = float(int32_t(m)) * 5.9604644775390625e-8f;  // m * 2^-24
  uint32_t sub_bits;
  std::memcpy(&sub_bits, &sub, sizeof sub_bits);
  const uint32_t bits = e == 0 ? (sub_bits | sign) : e == 31 ? special : normal;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even (IEEE's default), overflow to infinity, subnormal halves, every NaN the quiet NaN 0x7e00.
inline uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof x);
  const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return uint16_t(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
  if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // >= 65520 rounds to infinity
  if (ax < 0x38800000u) {  // below 2^-14: a subnormal half (or zero), q * 2^-24
    float a;
    std::memcpy(&a, &ax, sizeof a);
    return uint16_t(sign | uint32_t(std::nearbyint(a * 16777216.0f)));  // exact scaling, then ties to even
  }
  uint32_t h = ((ax >> 23) - 112u) << 10 | ((ax >> 13) & 0x3ffu);
  const uint32_t rest = ax & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is right
  return uint16_t(sign | h);
}

}  // namespace steady_num
