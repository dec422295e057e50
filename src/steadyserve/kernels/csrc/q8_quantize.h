// The activation quantization of q8.h, written once over a 16-value lane type.
//
// Included by every build of the int8 family (q8_scalar.cpp, q8_avx2.cpp, q8_avx512.cpp) inside its namespace,
// after the build's lanes header (lanes_scalar.h names the operations). Each value goes
// through the same IEEE operations in every build: amax is exact in any order, the scale is computed once
// per block as a scalar, x * s is one multiply, and the rounding is half to even (cvtps2dq under MXCSR's
// default, std::nearbyint in the scalar build); the sums are integers. So every build gives the same bits.
//
// Tiny blocks. For 0 < amax < 127 / FLT_MAX (about 3.7e-37: a block whose values are all subnormal or nearly),
// 127 / amax overflows to +inf and x * s is inf or NaN, whose conversion each build handled its own way (and the
// scalar build's was undefined). Blocks with amax below kTinyAmax = 2^-64 are therefore first multiplied by
// 2^64, exactly (a power of two, the results normal): q = round(x 2^64 * (127 / (amax 2^64))). Where the old
// formula was finite (amax >= 3.7e-37) this is the same float product, so the same q, as the old one: 2^64 and
// 2^-64 cancel exactly in both the scale and the product; below it, it is the q the formula means. dx stays
// amax / 127, subnormal or not: MXCSR is pinned (fp_env.h), so no build or thread flushes it.
constexpr float kTinyAmax = 0x1p-64f;
constexpr float kTinyScale = 0x1p64f;

// q = round-half-even(v * s) for 16 values (|v * s| <= 127 + rounding, so in int8's range); returns their sum.
namespace {
inline int32_t round_store(F v, float s, int8_t* q) {
  const I i = fround(fmul(v, fset1(s)));
  istore_i8(q, i);
  return ihsum(i);
}
}  // namespace

void quantize_rows(const float* x, int64_t x_stride, int64_t K, int64_t m0, int64_t m1, int8_t* xq, float* dx,
                   float* sxd, int32_t* sx, int32_t* zx16) {
  const int64_t blocks = K / kBlock;
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t c = 0; c < blocks; ++c) {
      const float* v = x + m * x_stride + c * kBlock;
      F lo = fload(v), hi = fload(v + 16);
      const bool finite = fall_finite(lo) && fall_finite(hi);
      const float amax = hmax(fmax(fabs(lo), fabs(hi)));  // exact in any order (used only when finite)
      const float d = finite ? amax / 127.0f : NAN;
      float s = finite && amax > 0.0f ? 127.0f / amax : 0.0f;
      if (finite && amax > 0.0f && amax < kTinyAmax) {  // 127 / amax could overflow: scale up first (see above)
        float up[kBlock];
        for (int k = 0; k < kBlock; ++k) up[k] = v[k] * kTinyScale;
        lo = fload(up);
        hi = fload(up + 16);
        s = 127.0f / (amax * kTinyScale);
      }
      int32_t sum_lo = 0, sum_hi = 0;
      int8_t* q = xq + m * K + c * kBlock;
      if (finite) {
        sum_lo = round_store(lo, s, q);
        sum_hi = round_store(hi, s, q + 16);
      } else {
        std::memset(q, 0, kBlock);
      }
      dx[m * blocks + c] = d;
      sx[m * blocks + c] = sum_lo + sum_hi;
      zx16[m * 2 * blocks + 2 * c] = -32 * sum_lo;  // Q6_K's zero point times the half's sum (q8.h's zx16)
      zx16[m * 2 * blocks + 2 * c + 1] = -32 * sum_hi;
      sxd[m * blocks + c] = d * float(sum_lo + sum_hi);
    }
  }
}

