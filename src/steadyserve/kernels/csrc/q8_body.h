// The body of the int8 family's vector builds, written once over the lanes (lanes_scalar.h names the operations;
// lanes_avx2.h documents the int8 products W, S, sdot, sdot_signed, widen, kSumRun and kSignedBias).
//
// Included by q8_avx2.cpp and q8_avx512.cpp inside their namespace, after the build's lanes header and its tile height
// kMM. W is 64 bytes: 16 panel rows x 4 values. sdot<BITS>(s, w, x4) adds to the partial sums s, for each panel row r,
// the 4 unsigned bytes of w's row r times the 4 signed bytes of x4; sdot_signed does the same with w's bytes signed
// (Q8_0), plus kSignedBias times the sum of x4 (a build may add 128 to each byte to use an unsigned product; tile_dots
// takes it off). widen(acc, s) adds each row's partial sums into its int32 lane of acc. A build may keep partial sums
// narrower than int32 (AVX2: int16 lanes, so one madd widens kSumRun<BITS> maddubs results, not one each);
// kSumRun<BITS> quads at most go into one S, the count whose sum the build shows cannot overflow S. All are exact
// integer sums: how a build forms them (vpdpbusd, maddubs/madd, in any grouping) never changes a value. The float part
// is q8.h's chain, one IEEE operation per lane per step, in the scalar build's order.

#include "q8_unpack.h"

// float(I_c) of q8.h for Q6_K, MM activation rows (row m's block at x + m K) against one panel's block, the rows
// interleaved operand by operand as tile_dots does, two integer chains per row: lo' = zx16_lo (-32 times the sum of
// the first 16 q) + the sum over the first 16 values of u q, hi' likewise over the last 16: each chain starts at its
// zero-point term, read as a broadcast (no subtract, no multiply, no move from a general register: a chain of those
// per half and row was the hottest code of the Q6_K tile). I_c = sc_lo lo' + sc_hi hi'. |lo'|, |hi'|
// <= 16 * 32 * 127 and |sc| <= 128, so each product is below 2^24 and exact in float; one fma then rounds the exact
// I_c once: fma(sc_lo, lo', sc_hi * hi') == float(I_c), the same float the other formats convert (and no 32-bit
// integer multiplies, which take two uops each on one port). fsc_lo, fsc_hi: the sub-scales as floats (exact).
template <int MM>
inline void sub_block_floats(const W (&w)[8], const int8_t* x, int64_t K, const int32_t* zx16, int64_t blocks,
                             const F& fsc_lo, const F& fsc_hi, F (&out)[MM]) {
  constexpr int R = MM < 4 ? MM : 4;  // rows per pass: 2 R chains, the 8 operands and the tile's accumulators fit
#pragma GCC unroll 2
  for (int m0 = 0; m0 < MM; m0 += R) {
    constexpr int run = kSumRun<6> < 4 ? kSumRun<6> : 4;  // quads per partial sum (4 in each half)
    static_assert(4 % run == 0, "a run may not cross a half's 4 quads");
    I lo[R], hi[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      if (m0 + r < MM) {
        const int32_t* z = zx16 + 2 * (m0 + r) * blocks;
        lo[r] = iset1(z[0]), hi[r] = iset1(z[1]);
      } else {
        lo[r] = izero(), hi[r] = izero();
      }
    }
#pragma GCC unroll 4
    for (int j0 = 0; j0 < 4; j0 += run) {
      S slo[R], shi[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) slo[r] = szero(), shi[r] = szero();
#pragma GCC unroll 4
      for (int j = j0; j < j0 + run; ++j) {
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          if (m0 + r < MM) {
            const int8_t* xr = x + (m0 + r) * K;
            slo[r] = sdot<6>(slo[r], w[j], x4_at(xr + 4 * j));
            shi[r] = sdot<6>(shi[r], w[j + 4], x4_at(xr + 16 + 4 * j));
          }
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) lo[r] = widen(lo[r], slo[r]), hi[r] = widen(hi[r], shi[r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      if (m0 + r < MM) out[m0 + r] = ffma(fsc_lo, i2f(lo[r]), fmul(fsc_hi, i2f(hi[r])));
    }
  }
}

// N * (*v) in every lane, N a power of two: a broadcast read and a shift, both on the vector side (the product formed
// in a general register and moved across was a chain of three per row and block in the tiles' hot loop).
template <int32_t N>
inline I pow2_times(const int32_t* v) {
  static_assert(N > 0 && (N & (N - 1)) == 0, "a power of two");
  return isll(iset1(*v), __builtin_ctz(unsigned(N)));
}

// I_c of q8.h for MM activation rows (row m's block at x + m K) against one panel's block: one integer chain per
// row, the rows interleaved operand by operand, so that MM independent chains keep the dot-product units busy
// while the 8 operands, the chains and the float accumulators stay in registers. sx: row m's sum at sx[m * blocks].
template <int BITS, int ZERO, int MM>
inline void tile_dots(const W (&w)[8], const int8_t* x, int64_t K, const int32_t* sx, int64_t blocks, I (&out)[MM]) {
  constexpr int VB = steady_fmt::value_bits(BITS, ZERO);  // MXFP4's table values count as 5 bits
  constexpr int run = kSumRun<VB> < 8 ? kSumRun<VB> : 8;  // quads per partial sum
  static_assert(8 % run == 0, "runs tile a block's 8 quads exactly");
#pragma GCC unroll 16
  for (int m = 0; m < MM; ++m) out[m] = izero();
#pragma GCC unroll 8
  for (int j0 = 0; j0 < 8; j0 += run) {
    S s[MM];
#pragma GCC unroll 16
    for (int m = 0; m < MM; ++m) s[m] = szero();
#pragma GCC unroll 8
    for (int j = j0; j < j0 + run; ++j) {
#pragma GCC unroll 16
      for (int m = 0; m < MM; ++m) {
        const int32_t x4 = x4_at(x + m * K + 4 * j);
        s[m] = BITS == 8 ? sdot_signed(s[m], w[j], x4) : sdot<VB>(s[m], w[j], x4);
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < MM; ++m) out[m] = widen(out[m], s[m]);
  }
#pragma GCC unroll 16
  for (int m = 0; m < MM; ++m) {
    if constexpr (BITS == 8) {
      if constexpr (kSignedBias != 0) out[m] = isub(out[m], pow2_times<kSignedBias>(sx + m * blocks));
    } else if constexpr (ZERO != 0) {
      out[m] = isub(out[m], pow2_times<ZERO>(sx + m * blocks));
    }
  }
}

// y[m0 .. m0 + MM, 16 p .. 16 p + 16] for one panel p. KQ: records of 8 blocks with the K-quants' scales.
template <int BITS, int ZERO, bool MIN, bool SUB, bool KQ, int MM>
inline void panel_tile(const Q8Args& a, int64_t p, int64_t m0) {
  const int64_t blocks = a.K / kBlock;
  constexpr int per = KQ ? 8 : 1;
  constexpr int qbytes = steady_fmt::qbytes(BITS);
  F acc[MM];
  for (int m = 0; m < MM; ++m) acc[m] = fzero();
  const uint8_t* rec = a.w + p * (blocks / per) * a.lay.record;
  const Prefetch ahead = a.ahead;  // held in registers for the whole panel
  for (int64_t c0 = 0; c0 < blocks; c0 += per, rec += a.lay.record) {
    const uint8_t* sc = rec + per * qbytes;  // q8.h's scale fields
    const F d = h2f(sc);
    const F d2 = MIN ? h2f(sc + steady_fmt::kScaleM) : fzero();  // Q4_1's m, or the K-quants' dmin
    for (int i = 0; i < per; ++i) {
      const int64_t c = c0 + i;
      if (m0 == 0) prefetch_ahead(rec, a.lay.record, per, i, ahead);  // later tiles of rows find the panel in cache
      W w[8];
      unpack<BITS, ZERO>(rec + i * qbytes, w);
      F wa = d, wb = d2;
      if constexpr (KQ && MIN) {  // a = d * sc, b = -(dmin * mn)
        wa = fmul(d, i2f(iload_u8(sc + steady_fmt::kScaleSc + 16 * i)));
        wb = fneg(fmul(d2, i2f(iload_u8(sc + steady_fmt::kScaleMn + 16 * i))));
      }
      F fdot[MM];  // float(I_c) per row
      if constexpr (SUB) {
        static_assert(ZERO == 32, "Q6_K's zero point");
        sub_block_floats<MM>(w, a.xq + m0 * a.K + c * kBlock, a.K, a.zx16 + 2 * (m0 * blocks + c), blocks,
                             i2f(iload_i8(sc + steady_fmt::kScaleSub + 32 * i)),
                             i2f(iload_i8(sc + steady_fmt::kScaleSub + 16 + 32 * i)), fdot);
      } else {
        I dotv[MM];
        tile_dots<BITS, ZERO, MM>(w, a.xq + m0 * a.K + c * kBlock, a.K, a.sx + m0 * blocks + c, blocks, dotv);
#pragma GCC unroll 16
        for (int m = 0; m < MM; ++m) fdot[m] = i2f(dotv[m]);
      }
#pragma GCC unroll 16
      for (int m = 0; m < MM; ++m) {
        const int64_t at = (m0 + m) * blocks + c;
        acc[m] = ffma(wa, fmul(fdot[m], fset1(a.dx[at])), acc[m]);  // t = float(I) * dx; acc = fma(a, t, acc)
        if constexpr (MIN) acc[m] = ffma(wb, fset1(a.sxd[at]), acc[m]);  // acc = fma(b, sxd, acc)
      }
    }
  }
  for (int m = 0; m < MM; ++m) fstore(a.y + (m0 + m) * a.y_stride + p * kPanel, acc[m]);
}

template <int BITS, int ZERO, bool MIN, bool SUB, bool KQ, int MM = kMM>
inline void panel_tail(const Q8Args& a, int64_t p, int64_t m0, int64_t rest) {
  if constexpr (MM > 0) {
    if (rest == MM) {
      panel_tile<BITS, ZERO, MIN, SUB, KQ, MM>(a, p, m0);
    } else {
      panel_tail<BITS, ZERO, MIN, SUB, KQ, MM - 1>(a, p, m0, rest);
    }
  }
}

template <int BITS, int ZERO, bool MIN, bool SUB, bool KQ>
void matmul_fmt(const Q8Args& a) {
  for (int64_t p = a.p_begin; p < a.p_end; ++p) {
    int64_t m = 0;
    for (; m + kMM <= a.M; m += kMM) panel_tile<BITS, ZERO, MIN, SUB, KQ, kMM>(a, p, m);
    if (m < a.M) panel_tail<BITS, ZERO, MIN, SUB, KQ>(a, p, m, a.M - m);
  }
}

}  // namespace (the build's private helpers end here)

void matmul(const Q8Args& a) {  // q8linear.cpp refuses other formats before calling
  steady_fmt::with_format<true>(a.fmt, [&]<steady_fmt::Traits T>() {
    matmul_fmt<T.bits, T.zero, T.has_min, T.sub_scales, T.k_quant>(a);
  });
}
