// The largest output of each panel of 16 columns, written once over a 16-value lane type: the LM head's residual
// rows (q8.h, "Residual rows") correct the panels whose largest output lies within a margin of the row's largest.
//
// Included by every build of the int8 family (q8_scalar.cpp, q8_avx2.cpp, q8_avx512.cpp) inside its namespace,
// after the build's lanes header. A NaN lane is replaced by -inf first (fmax returns its second operand where either
// is NaN: lanes_scalar.h), so a NaN never counts as a panel's largest; the max of the rest is exact in any order. So
// every build gives the same floats.

// tops[m * tops_stride + p] = the largest non-NaN output of row m's panel p (-inf where there is none), for rows
// [0, M) of y (row stride y_stride floats) and panels [p0, p1).
void panel_tops(const float* y, int64_t y_stride, int64_t M, int64_t p0, int64_t p1, float* tops,
                int64_t tops_stride) {
  const F none = fset1(-INFINITY);
  for (int64_t m = 0; m < M; ++m) {
    const float* ym = y + m * y_stride;
    float* tm = tops + m * tops_stride;
    int64_t p = p0;
    for (; p + 4 <= p1; p += 4)  // four panels' maxima from one tree (lanes_*.h hmax4)
      hmax4(fmax(fload(ym + p * 16), none), fmax(fload(ym + p * 16 + 16), none), fmax(fload(ym + p * 16 + 32), none),
            fmax(fload(ym + p * 16 + 48), none), tm + p);
    for (; p < p1; ++p) tm[p] = hmax(fmax(fload(ym + p * 16), none));
  }
}
