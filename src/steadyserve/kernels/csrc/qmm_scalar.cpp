// The scalar build of the matmul family: the reference. 16 lanes in a plain array, each
// operation a loop over them, std::fmaf for the fused multiply-add (exactly rounded on any
// CPU). It runs where neither vector build can, and the tests hold both vector builds to
// its bits (qmm.h documents the order all three share).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "half.h"
#include "qmm.h"

namespace steady_qmm {
namespace scalar {
namespace {

struct F {
  float v[16];
};
struct I {
  int32_t v[16];
};

constexpr int kSmallM = 1;
constexpr int fused_nr(int) { return 1; }
constexpr int kMR = 1;
constexpr int kNR = 1;
constexpr int64_t kMB = 96;
constexpr int64_t kPrefetchTiles = 0;
inline void prefetch(const uint8_t*) {}

using steady_num::half_to_float;
inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return half_to_float(h);
}

#define LANES for (int i = 0; i < 16; ++i)
inline F fzero() { F r; LANES r.v[i] = 0.0f; return r; }
inline F fset1(float x) { F r; LANES r.v[i] = x; return r; }
inline F fload(const float* p) { F r; std::memcpy(r.v, p, sizeof r.v); return r; }
inline void fstore(float* p, F x) { std::memcpy(p, x.v, sizeof x.v); }
inline F ffma(F a, F b, F c) { F r; LANES r.v[i] = std::fmaf(a.v[i], b.v[i], c.v[i]); return r; }
inline F fmul(F a, F b) { F r; LANES r.v[i] = a.v[i] * b.v[i]; return r; }
inline F fadd(F a, F b) { F r; LANES r.v[i] = a.v[i] + b.v[i]; return r; }
inline F fsub(F a, F b) { F r; LANES r.v[i] = a.v[i] - b.v[i]; return r; }
inline F fdiv(F a, F b) { F r; LANES r.v[i] = a.v[i] / b.v[i]; return r; }
// max/min as x86's maxps/minps: the second operand when the first is not greater (NaN included).
inline F fmax(F a, F b) { F r; LANES r.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i]; return r; }
inline F fmin(F a, F b) { F r; LANES r.v[i] = a.v[i] < b.v[i] ? a.v[i] : b.v[i]; return r; }
// The fixed tree of qmm.h: lanes i + 8, then + 4, + 2, + 1.
inline float hsum(F x) {
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = x.v[i] + x.v[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  const float s2_0 = s4[0] + s4[2], s2_1 = s4[1] + s4[3];
  return s2_0 + s2_1;
}
inline void hsum4(F a, F b, F c, F d, float* out) {  // four of hsum's trees
  out[0] = hsum(a), out[1] = hsum(b), out[2] = hsum(c), out[3] = hsum(d);
}
inline float hmax(F x) { float m = x.v[0]; for (int i = 1; i < 16; ++i) m = x.v[i] > m ? x.v[i] : m; return m; }
inline uint32_t fmask_eq(F a, F b) { uint32_t r = 0; LANES r |= uint32_t(a.v[i] == b.v[i]) << i; return r; }
inline uint32_t fmask_nan(F a) { uint32_t r = 0; LANES r |= uint32_t(a.v[i] != a.v[i]) << i; return r; }
inline I iset1(int32_t x) { I r; LANES r.v[i] = x; return r; }
inline I ilanes() { I r; LANES r.v[i] = i; return r; }
inline I iload_u8(const uint8_t* p) { I r; LANES r.v[i] = p[i]; return r; }
inline I iload_i8(const uint8_t* p) { I r; LANES r.v[i] = int8_t(p[i]); return r; }
inline I iload_u16(const uint8_t* p) { I r; LANES { uint16_t h; std::memcpy(&h, p + 2 * i, 2); r.v[i] = h; } return r; }
inline I iand(I a, int32_t m) { I r; LANES r.v[i] = a.v[i] & m; return r; }
inline I isrl(I a, int n) { I r; LANES r.v[i] = int32_t(uint32_t(a.v[i]) >> n); return r; }
inline I isll(I a, int n) { I r; LANES r.v[i] = int32_t(uint32_t(a.v[i]) << n); return r; }
inline I isrlv(I a, I n) { I r; LANES r.v[i] = n.v[i] < 32 ? int32_t(uint32_t(a.v[i]) >> n.v[i]) : 0; return r; }
inline I ior(I a, I b) { I r; LANES r.v[i] = a.v[i] | b.v[i]; return r; }
inline I isub(I a, I b) { I r; LANES r.v[i] = a.v[i] - b.v[i]; return r; }
inline I iadd(I a, I b) { I r; LANES r.v[i] = a.v[i] + b.v[i]; return r; }
inline F i2f(I a) { F r; LANES r.v[i] = float(a.v[i]); return r; }
inline I f2i(F a) { I r; LANES r.v[i] = int32_t(a.v[i]); return r; }  // integral inputs only (fexp)
inline F ibits2f(I a) { F r; std::memcpy(r.v, a.v, sizeof r.v); return r; }
inline F h2f(const uint8_t* p) { F r; LANES { uint16_t h; std::memcpy(&h, p + 2 * i, 2); r.v[i] = half_to_float(h); } return r; }
#undef LANES

#include "qmm_body.h"

}  // namespace scalar
}  // namespace steady_qmm
