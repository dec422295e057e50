// The body of the int8 family's vector builds, written once over a 16-lane abstraction.
//
// Included by q8_avx2.cpp and q8_avx512.cpp inside their namespace, after each has defined:
//   W (64 bytes: 16 panel rows x 4 values), I (16 int32), F (16 float) and
//   wload wand wsrl16 wsll16 wor | dot dot_signed kSignedBias izero isub_bcast iadd imul i8load | f_of_i fmul_bcast fzero
//   fmul fneg h2f16 (16 binary16, exactly) u8f (16 bytes as floats) ffma ffma_bcast fstore, and the tile height kMM.
// dot(acc, w, x4) adds to each lane r the sum of w's 4 unsigned bytes of row r times the 4 signed bytes
// of x4; dot_signed does the same with w's bytes signed (Q8_0), plus kSignedBias times the sum of x4 (a
// build may add 128 to each byte to use an unsigned product; tile_dots takes it off). Both are exact integer sums: how a build
// forms them (vpdpbusd, maddubs/madd) never changes a value. The float part is q8.h's chain, one
// IEEE operation per lane per step, in the scalar build's order.

#include "q8_unpack.h"

// I_c of q8.h for Q6_K, the 16 rows of a panel and one activation row (xrow: its block's 32 int8): two halves,
// each (u - 32) . q, times its int8 sub-scale.
template <int ZERO>
inline I sub_block_dot(const W (&w)[8], const int8_t* xrow, const int32_t* sx16, const I& sc_lo, const I& sc_hi) {
  I lo = izero(), hi = izero();
  for (int j = 0; j < 4; ++j) lo = dot(lo, w[j], x4_at(xrow + 4 * j));
  for (int j = 4; j < 8; ++j) hi = dot(hi, w[j], x4_at(xrow + 4 * j));
  return iadd(imul(sc_lo, isub_bcast(lo, ZERO * sx16[0])), imul(sc_hi, isub_bcast(hi, ZERO * sx16[1])));
}

// I_c of q8.h for MM activation rows (row m's block at x + m K) against one panel's block: one integer chain per
// row, the rows interleaved operand by operand, so that MM independent chains keep the dot-product units busy
// while the 8 operands, the chains and the float accumulators stay in registers. sx: row m's sum at sx[m * blocks].
template <int BITS, int ZERO, int MM>
inline void tile_dots(const W (&w)[8], const int8_t* x, int64_t K, const int32_t* sx, int64_t blocks, I (&out)[MM]) {
#pragma GCC unroll 16
  for (int m = 0; m < MM; ++m) out[m] = izero();
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
#pragma GCC unroll 16
    for (int m = 0; m < MM; ++m) {
      const int32_t x4 = x4_at(x + m * K + 4 * j);
      out[m] = BITS == 8 ? dot_signed(out[m], w[j], x4) : dot(out[m], w[j], x4);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MM; ++m) {
    if constexpr (BITS == 8) {
      if (kSignedBias) out[m] = isub_bcast(out[m], kSignedBias * sx[m * blocks]);
    } else if constexpr (ZERO != 0) {
      out[m] = isub_bcast(out[m], ZERO * sx[m * blocks]);
    }
  }
}

// y[m0 .. m0 + MM, 16 p .. 16 p + 16] for one panel p. KQ: records of 8 blocks with the K-quants' scales.
template <int BITS, int ZERO, bool MIN, bool SUB, bool KQ, int MM>
inline void panel_tile(const Q8Args& a, int64_t p, int64_t m0) {
  const int64_t blocks = a.K / kBlock;
  constexpr int per = KQ ? 8 : 1;
  constexpr int qbytes = BITS == 8 ? 512 : BITS == 4 ? 256 : BITS == 5 ? 320 : 384;
  F acc[MM];
  for (int m = 0; m < MM; ++m) acc[m] = fzero();
  const uint8_t* rec = a.w + p * (blocks / per) * a.lay.record;
  for (int64_t c0 = 0; c0 < blocks; c0 += per, rec += a.lay.record) {
    const uint8_t* sc = rec + per * qbytes;  // q8.h's scale fields
    const F d = h2f16(sc);
    const F d2 = MIN ? h2f16(sc + 32) : fzero();  // Q4_1's m, or the K-quants' dmin
    for (int i = 0; i < per; ++i) {
      const int64_t c = c0 + i;
      if (m0 == 0) prefetch_ahead(rec, a.lay.record, per, i);  // later tiles of rows find the panel in cache
      W w[8];
      unpack<BITS>(rec + i * qbytes, w);
      F wa = d, wb = d2;
      if constexpr (KQ && MIN) {  // a = d * sc, b = -(dmin * mn)
        wa = fmul(d, u8f(sc + 64 + 16 * i));
        wb = fneg(fmul(d2, u8f(sc + 192 + 16 * i)));
      }
      const I sc_lo = SUB ? i8load(sc + 32 + 32 * i) : izero(), sc_hi = SUB ? i8load(sc + 48 + 32 * i) : izero();
      I dotv[MM];
      if constexpr (SUB) {
        for (int m = 0; m < MM; ++m) {
          const int64_t at = (m0 + m) * blocks + c;
          dotv[m] = sub_block_dot<ZERO>(w, a.xq + (m0 + m) * a.K + c * kBlock, a.sx16 + 2 * at, sc_lo, sc_hi);
        }
      } else {
        tile_dots<BITS, ZERO, MM>(w, a.xq + m0 * a.K + c * kBlock, a.K, a.sx + m0 * blocks + c, blocks, dotv);
      }
#pragma GCC unroll 16
      for (int m = 0; m < MM; ++m) {
        const int64_t at = (m0 + m) * blocks + c;
        acc[m] = ffma(wa, fmul_bcast(f_of_i(dotv[m]), a.dx[at]), acc[m]);  // t = float(I) * dx; acc = fma(a, t, acc)
        if constexpr (MIN) acc[m] = ffma_bcast(wb, a.sxd[at], acc[m]);  // acc = fma(b, sxd, acc)
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

void matmul(const Q8Args& a) {
  switch (a.fmt) {
    case 2: matmul_fmt<4, 8, false, false, false>(a); break;   // Q4_0
    case 3: matmul_fmt<4, 0, true, false, false>(a); break;    // Q4_1
    case 6: matmul_fmt<5, 16, false, false, false>(a); break;  // Q5_0
    case 8: matmul_fmt<8, 0, false, false, false>(a); break;   // Q8_0
    case 12: matmul_fmt<4, 0, true, false, true>(a); break;    // Q4_K
    case 13: matmul_fmt<5, 0, true, false, true>(a); break;    // Q5_K
    case 14: matmul_fmt<6, 32, false, true, true>(a); break;   // Q6_K
    default: break;  // q8linear.cpp refuses other formats before calling
  }
}
