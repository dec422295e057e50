// IEEE binary16 -> binary32 in portable C++: every half is exactly a float, so this equals F16C's
// vcvtph2ps bit for bit. Shared by the float32 matmul family (qmm_body.h) and the int8 one (q8_pack.cpp).
#pragma once

#include <cstdint>
#include <cstring>

namespace steady_num {

inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal half: a normal float
      uint32_t s = 0;
      while (!(mant & 0x400u)) { mant <<= 1; ++s; }
      bits = sign | ((113u - s) << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0u);  // NaNs come out quiet
  } else {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace steady_num
