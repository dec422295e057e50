// Functions of the lanes written once over their operations (lanes_scalar.h names them), for every build and family:
// included inside a build's namespace after its lanes header, by qmm_body.h and attention_rows.h.

// exp(x) per lane from IEEE mul/add/sub only (Cephes expf coefficients, ~1 ulp), for x in [-87, 88]: libm's expf may
// differ between machines (glibc picks an FMA variant by CPU), this does not. The caller bounds x its own way.
inline F fexp_bounded(F x) {
  const F n = fsub(fadd(fmul(x, fset1(1.44269504088896341f)), fset1(12582912.0f)), fset1(12582912.0f));  // round(x log2 e)
  const F r = fsub(fsub(x, fmul(n, fset1(0.693359375f))), fmul(n, fset1(-2.12194440e-4f)));
  F p = fadd(fmul(r, fset1(1.9875691500e-4f)), fset1(1.3981999507e-3f));
  p = fadd(fmul(p, r), fset1(8.3334519073e-3f));
  p = fadd(fmul(p, r), fset1(4.1665795894e-2f));
  p = fadd(fmul(p, r), fset1(1.6666665459e-1f));
  p = fadd(fmul(p, r), fset1(5.0000001201e-1f));
  const F y = fadd(fadd(fmul(p, fmul(r, r)), r), fset1(1.0f));
  return fmul(y, ibits2f(isll(iadd(f2i(n), iset1(127)), 23)));  // y * 2^n
}
