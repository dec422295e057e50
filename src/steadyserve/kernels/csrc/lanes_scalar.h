// The lanes every kernel body is written over, and the scalar (baseline x86-64) build of them: 16 lanes in a plain
// array, each operation a loop over them. lanes_avx2.h and lanes_avx512.h define the same names with the same
// meaning; a kernel body (qmm_body.h, q8_body.h, q8_quantize.h, attention_rows.h) uses these names alone, so adding
// an instruction set is one more lanes file plus one line per family in isa.h's dispatch.
//
// Every float operation is one IEEE operation per lane (ffma: one rounding, std::fmaf here), so each build computes
// the same value in every lane; only how many lanes share a register differs. The operations:
//   F (16 floats): fzero fset1 fload fstore ffma fmul fadd fsub fdiv fabs fneg
//     fmax(a, b), fmin(a, b): x86's maxps/minps: a if a > b (a < b), else b (so b where either is NaN)
//     fzero_lt(v, x, lim): 0 in the lanes where x < lim, v elsewhere (NaN x keeps v)
//     hsum: lanes i + 8, then + 4, + 2, + 1 (the fixed tree of qmm.h); hsum4: four of them; hmax: the max (exact in
//     any order for non-NaN lanes); hmax4: four of them; fmask_eq, fmask_nan: lane i -> bit i; fall_finite: no lane inf or NaN
//   I (16 int32): izero iset1 ilanes (0..15) iload istore iload_u8 iload_i8 iload_u16 (16 bytes / shorts widened)
//     istore_i8 (values in [-128, 127]) iand isrl isll isrlv ior isub iadd ihsum (an integer sum: any order)
//     i2f (round to nearest even), f2i (truncate; integral inputs), fround (round half to even; inputs in range),
//     ibits2f (the bits as floats)
//   binary16: half_at (one at p, exactly), h2f (16 at p, exactly), fstore_h (16 halves, round to nearest even; a NaN
//     lane's bits are not promised: callers send NaNs through half.h's float_to_half)
//   prefetch: a hint, never a fault nor a value.
// The vector builds also define the int8 products (W, S, sdot, ...: lanes_avx2.h documents them). Here only the signed
// one, for the q8_0 cache's integer attention scores (attention_rows.h); the scalar int8 matmul build is the
// reference written as plain loops instead (q8_scalar.cpp).
//
// Included inside a kernel family's build namespace (qmm_scalar.cpp, q8_scalar.cpp, attention_scalar.cpp), after
// half.h and the standard headers.

#define STEADY_LANES for (int i = 0; i < 16; ++i)

// ---- float lanes ----
struct F {
  float v[16];
};
inline F fzero() { F r; STEADY_LANES r.v[i] = 0.0f; return r; }
inline F fset1(float x) { F r; STEADY_LANES r.v[i] = x; return r; }
inline F fload(const float* p) { F r; std::memcpy(r.v, p, sizeof r.v); return r; }
inline void fstore(float* p, F x) { std::memcpy(p, x.v, sizeof x.v); }
inline F ffma(F a, F b, F c) { F r; STEADY_LANES r.v[i] = std::fmaf(a.v[i], b.v[i], c.v[i]); return r; }
inline F fmul(F a, F b) { F r; STEADY_LANES r.v[i] = a.v[i] * b.v[i]; return r; }
inline F fadd(F a, F b) { F r; STEADY_LANES r.v[i] = a.v[i] + b.v[i]; return r; }
inline F fsub(F a, F b) { F r; STEADY_LANES r.v[i] = a.v[i] - b.v[i]; return r; }
inline F fdiv(F a, F b) { F r; STEADY_LANES r.v[i] = a.v[i] / b.v[i]; return r; }
inline F fmax(F a, F b) { F r; STEADY_LANES r.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i]; return r; }
inline F fmin(F a, F b) { F r; STEADY_LANES r.v[i] = a.v[i] < b.v[i] ? a.v[i] : b.v[i]; return r; }
inline F fabs(F a) { F r; STEADY_LANES r.v[i] = std::fabs(a.v[i]); return r; }
inline F fneg(F a) { F r; STEADY_LANES r.v[i] = -a.v[i]; return r; }
inline F fzero_lt(F v, F x, float lim) { F r; STEADY_LANES r.v[i] = x.v[i] < lim ? 0.0f : v.v[i]; return r; }
inline float hsum(F x) {
  float s8[8], s4[4];
  for (int i = 0; i < 8; ++i) s8[i] = x.v[i] + x.v[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  const float s2_0 = s4[0] + s4[2], s2_1 = s4[1] + s4[3];
  return s2_0 + s2_1;
}
inline void hsum4(F a, F b, F c, F d, float* out) { out[0] = hsum(a), out[1] = hsum(b), out[2] = hsum(c), out[3] = hsum(d); }
inline float hmax(F x) { float m = x.v[0]; for (int i = 1; i < 16; ++i) m = x.v[i] > m ? x.v[i] : m; return m; }
inline void hmax4(F a, F b, F c, F d, float* out) { out[0] = hmax(a), out[1] = hmax(b), out[2] = hmax(c), out[3] = hmax(d); }
inline uint32_t fmask_eq(F a, F b) { uint32_t r = 0; STEADY_LANES r |= uint32_t(a.v[i] == b.v[i]) << i; return r; }
inline uint32_t fmask_nan(F a) { uint32_t r = 0; STEADY_LANES r |= uint32_t(a.v[i] != a.v[i]) << i; return r; }
inline bool fall_finite(F a) { bool ok = true; STEADY_LANES ok = ok && std::isfinite(a.v[i]); return ok; }

// ---- int32 lanes ----
struct I {
  int32_t v[16];
};
inline I izero() { I r; STEADY_LANES r.v[i] = 0; return r; }
inline I iset1(int32_t x) { I r; STEADY_LANES r.v[i] = x; return r; }
inline I ilanes() { I r; STEADY_LANES r.v[i] = i; return r; }
inline I iload(const int32_t* p) { I r; std::memcpy(r.v, p, sizeof r.v); return r; }
inline void istore(int32_t* p, I x) { std::memcpy(p, x.v, sizeof x.v); }
inline I iload_u8(const uint8_t* p) { I r; STEADY_LANES r.v[i] = p[i]; return r; }
inline I iload_i8(const uint8_t* p) { I r; STEADY_LANES r.v[i] = int8_t(p[i]); return r; }
inline I iload_u16(const uint8_t* p) { I r; STEADY_LANES { uint16_t h; std::memcpy(&h, p + 2 * i, 2); r.v[i] = h; } return r; }
inline void istore_i8(int8_t* p, I x) { STEADY_LANES p[i] = int8_t(x.v[i]); }
inline I iand(I a, int32_t m) { I r; STEADY_LANES r.v[i] = a.v[i] & m; return r; }
inline I isrl(I a, int n) { I r; STEADY_LANES r.v[i] = int32_t(uint32_t(a.v[i]) >> n); return r; }
inline I isll(I a, int n) { I r; STEADY_LANES r.v[i] = int32_t(uint32_t(a.v[i]) << n); return r; }
inline I isrlv(I a, I n) { I r; STEADY_LANES r.v[i] = n.v[i] < 32 ? int32_t(uint32_t(a.v[i]) >> n.v[i]) : 0; return r; }
inline I ior(I a, I b) { I r; STEADY_LANES r.v[i] = a.v[i] | b.v[i]; return r; }
inline I isub(I a, I b) { I r; STEADY_LANES r.v[i] = a.v[i] - b.v[i]; return r; }
inline I iadd(I a, I b) { I r; STEADY_LANES r.v[i] = a.v[i] + b.v[i]; return r; }
inline int32_t ihsum(I a) { int32_t s = 0; STEADY_LANES s += a.v[i]; return s; }
inline F i2f(I a) { F r; STEADY_LANES r.v[i] = float(a.v[i]); return r; }
inline I f2i(F a) { I r; STEADY_LANES r.v[i] = int32_t(a.v[i]); return r; }
inline I fround(F a) { I r; STEADY_LANES r.v[i] = int32_t(std::nearbyint(a.v[i])); return r; }  // MXCSR: to even
inline F ibits2f(I a) { F r; std::memcpy(r.v, a.v, sizeof r.v); return r; }

// ---- binary16 (half.h's portable conversions) ----
inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return steady_num::half_to_float(h);
}
inline F h2f(const uint8_t* p) {
  uint16_t h[16];
  std::memcpy(h, p, sizeof h);
  F r;
  STEADY_LANES r.v[i] = steady_num::half_to_float(h[i]);
  return r;
}
inline void fstore_h(uint16_t* p, F x) { STEADY_LANES p[i] = steady_num::float_to_half(x.v[i]); }

inline void prefetch(const uint8_t*) {}

#undef STEADY_LANES

// ---- the signed int8 product (attention_rows.h's integer scores) ----
struct W {
  int8_t b[64];  // lane i's 4 bytes at 4 i .. 4 i + 3
};
inline W wload(const uint8_t* p) { W r; std::memcpy(r.b, p, sizeof r.b); return r; }
using S = I;  // partial sums straight in int32 lanes
template <int BITS>
constexpr int kSumRun = 8;
constexpr int32_t kSignedBias = 0;  // the products are formed signed
inline S szero() { return izero(); }
// Lane i += the dot product of w's 4 signed bytes of lane i with x4's 4 signed bytes (byte 0 the lowest).
inline S sdot_signed(S s, W w, int32_t x4) {
  int8_t x[4];
  std::memcpy(x, &x4, 4);
  for (int i = 0; i < 16; ++i)
    for (int b = 0; b < 4; ++b) s.v[i] += int32_t(w.b[4 * i + b]) * int32_t(x[b]);
  return s;
}
inline I widen(I acc, S s) { return iadd(acc, s); }
