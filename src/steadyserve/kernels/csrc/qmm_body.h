// The body of the matmul family, written once over the lanes (lanes_scalar.h names the operations).
//
// Included by qmm_scalar.cpp, qmm_avx2.cpp and qmm_avx512.cpp inside their namespace, after the build's lanes header
// and its tile sizes: kSmallM fused_nr(MM) kMR kNR kMB kPrefetchTiles. Every lane operation is one IEEE operation per
// lane (ffma: one rounding), so each build computes the same value in every lane; only the tile sizes, which never
// change a lane's sequence of operations, differ between builds. The reduction order is documented in qmm.h.

// ---- scalar helpers (the same code in every build) ----

// Natural log for x >= 1 from IEEE mul/add/sub only (Cephes logf, ~1 ulp): libm's log may
// differ between machines (glibc picks an FMA variant by CPU), this does not.
inline float det_log(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  int32_t e = int32_t((bits >> 23) & 0xffu) - 126;
  bits = (bits & 0x807fffffu) | 0x3f000000u;  // mantissa in [0.5, 1)
  float m;
  std::memcpy(&m, &bits, sizeof m);
  if (m < 0.707106781186547524f) {
    e -= 1;
    m = (m + m) - 1.0f;
  } else {
    m = m - 1.0f;
  }
  const float z = m * m;
  float y = 7.0376836292E-2f;
  y = y * m - 1.1514610310E-1f;
  y = y * m + 1.1676998740E-1f;
  y = y * m - 1.2420140846E-1f;
  y = y * m + 1.4249322787E-1f;
  y = y * m - 1.6668057665E-1f;
  y = y * m + 2.0000714765E-1f;
  y = y * m - 2.4999993993E-1f;
  y = y * m + 3.3333331174E-1f;
  y = (y * m) * z;
  const float fe = float(e);
  y = y + (-2.12194440e-4f * fe);
  y = y - 0.5f * z;
  return (m + y) + 0.693359375f * fe;
}

#include "lanes_math.h"

// exp(x) per lane, x clamped to [-87, 88] (a NaN lane becomes -87's exp: fmax returns its second operand).
inline F fexp(F x) { return fexp_bounded(fmin(fmax(x, fset1(-87.0f)), fset1(88.0f))); }

// ---- dequantization: 32 consecutive weights (chunk c = k / 32) of one row into two vectors ----
// Each format uses gguf-py's operations in gguf-py's order (gguf/quants.py), so the values
// equal its dequantizer's bitwise (tests/test_qmm.py checks it on real tensors).

template <int FMT>
inline void deq32(const uint8_t* row, int64_t c, F& lo, F& hi) {
  if constexpr (FMT == F32) {
    const float* p = reinterpret_cast<const float*>(row) + 32 * c;
    lo = fload(p);
    hi = fload(p + 16);
  } else if constexpr (FMT == F16) {
    const uint8_t* p = row + 64 * c;
    lo = h2f(p);
    hi = h2f(p + 32);
  } else if constexpr (FMT == BF16) {
    const uint8_t* p = row + 64 * c;
    lo = ibits2f(isll(iload_u16(p), 16));
    hi = ibits2f(isll(iload_u16(p + 32), 16));
  } else if constexpr (FMT == Q8_0) {  // x * d
    const uint8_t* b = row + 34 * c;
    const F d = fset1(half_at(b));
    lo = fmul(i2f(iload_i8(b + 2)), d);
    hi = fmul(i2f(iload_i8(b + 18)), d);
  } else if constexpr (FMT == Q4_0) {  // d * (q - 8)
    const uint8_t* b = row + 18 * c;
    const F d = fset1(half_at(b));
    const I q = iload_u8(b + 2);
    lo = fmul(d, i2f(isub(iand(q, 15), iset1(8))));
    hi = fmul(d, i2f(isub(isrl(q, 4), iset1(8))));
  } else if constexpr (FMT == Q4_1) {  // (d * q) + m
    const uint8_t* b = row + 20 * c;
    const F d = fset1(half_at(b)), m = fset1(half_at(b + 2));
    const I q = iload_u8(b + 4);
    lo = fadd(fmul(d, i2f(iand(q, 15))), m);
    hi = fadd(fmul(d, i2f(isrl(q, 4))), m);
  } else if constexpr (FMT == Q5_0) {  // d * ((q | h << 4) - 16)
    const uint8_t* b = row + 22 * c;
    const F d = fset1(half_at(b));
    uint32_t qh;
    std::memcpy(&qh, b + 2, sizeof qh);
    const I q = iload_u8(b + 6);
    const I h_lo = iand(isrlv(iset1(int32_t(qh)), ilanes()), 1);
    const I h_hi = iand(isrlv(iset1(int32_t(qh >> 16)), ilanes()), 1);
    lo = fmul(d, i2f(isub(ior(iand(q, 15), isll(h_lo, 4)), iset1(16))));
    hi = fmul(d, i2f(isub(ior(isrl(q, 4), isll(h_hi, 4)), iset1(16))));
  } else if constexpr (FMT == Q4_K || FMT == Q5_K) {  // (d * sc) * q - (dmin * m)
    const int s = int(c % 8);
    const uint8_t* b = row + (FMT == Q4_K ? 144 : 176) * (c / 8);
    int sc, mn;
    steady_fmt::scale_min_k4(b + 4, s, &sc, &mn);
    const F ds = fset1(half_at(b) * float(sc)), dm = fset1(half_at(b + 2) * float(mn));
    const uint8_t* qs = b + (FMT == Q4_K ? 16 : 48) + 32 * (s / 2);
    const int shift = 4 * (s % 2);
    I q_lo = iand(isrl(iload_u8(qs), shift), 15), q_hi = iand(isrl(iload_u8(qs + 16), shift), 15);
    if constexpr (FMT == Q5_K) {
      const uint8_t* qh = b + 16;
      q_lo = ior(q_lo, isll(iand(isrl(iload_u8(qh), s), 1), 4));
      q_hi = ior(q_hi, isll(iand(isrl(iload_u8(qh + 16), s), 1), 4));
    }
    lo = fsub(fmul(ds, i2f(q_lo)), dm);
    hi = fsub(fmul(ds, i2f(q_hi)), dm);
  } else if constexpr (FMT == Q6_K) {  // (d * sc) * ((ql | qh << 4) - 32), a scale per 16 weights
    const int s = int(c % 8), h = s / 4, j = s % 4;
    const uint8_t* b = row + 210 * (c / 8);
    const uint8_t* ql = b + 64 * h + 32 * (j % 2);
    const uint8_t* qh = b + 128 + 32 * h;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * h + 2 * j;
    const float d = half_at(b + 208);
    const int qs = 4 * (j / 2), hs = 2 * j;
    const I q_lo = isub(ior(iand(isrl(iload_u8(ql), qs), 15), isll(iand(isrl(iload_u8(qh), hs), 3), 4)), iset1(32));
    const I q_hi =
        isub(ior(iand(isrl(iload_u8(ql + 16), qs), 15), isll(iand(isrl(iload_u8(qh + 16), hs), 3), 4)), iset1(32));
    lo = fmul(fset1(d * float(sc[0])), i2f(q_lo));
    hi = fmul(fset1(d * float(sc[1])), i2f(q_hi));
  } else if constexpr (FMT == MXFP4) {  // d * kvalue[q], d = 2^(e - 128): one product, exact (inf where it overflows)
    const uint8_t* b = row + 17 * c;
    int8_t v[32];  // the kvalues as bytes, then the lanes: no lane op looks a table up
    steady_fmt::mxfp4_values(b, v);
    const F d = fset1(steady_fmt::e8m0_half(b[0]));
    lo = fmul(d, i2f(iload_i8(reinterpret_cast<const uint8_t*>(v))));
    hi = fmul(d, i2f(iload_i8(reinterpret_cast<const uint8_t*>(v + 16))));
  }
}

// ---- the matmul: small M dequantizes into registers, large M into a panel reused by every row ----

// y[m * y_stride + n0 + r] = the lane tree of acc[m][r] (hsum4 packs four trees; the bits are hsum's).
template <int MM, int NN>
inline void store_sums(const F (&acc)[MM][NN], float* y, int64_t y_stride, int64_t n0) {
  for (int m = 0; m < MM; ++m) {
    int r = 0;
    for (; r + 4 <= NN; r += 4) hsum4(acc[m][r], acc[m][r + 1], acc[m][r + 2], acc[m][r + 3], y + m * y_stride + n0 + r);
    for (; r < NN; ++r) y[m * y_stride + n0 + r] = hsum(acc[m][r]);
  }
}

// y[m0 + m, n0 + r] for MM rows and NN weight rows, weights dequantized in registers.
template <int FMT, int MM, int NN>
inline void fused_tile(const MatmulArgs& a, int64_t n0) {
  F acc[MM][NN];
  for (int m = 0; m < MM; ++m)
    for (int r = 0; r < NN; ++r) acc[m][r] = fzero();
  const int64_t chunks = a.K / 32;
  // Rows are short (a few hundred bytes) and read NN at a time, too short for the hardware prefetcher to
  // follow as streams: prefetch the weight bytes of the tile kPrefetchTiles ahead, spread over this loop.
  const uint8_t* pf = a.w + (n0 + NN * kPrefetchTiles) * a.row_bytes;
  const int64_t pf_lines = (NN * a.row_bytes + 63) / 64, pf_step = (pf_lines + chunks - 1) / chunks;
  for (int64_t c = 0; c < chunks; ++c) {
    for (int64_t l = c * pf_step; l < (c + 1) * pf_step && l < pf_lines; ++l) prefetch(pf + 64 * l);
    F wl[NN], wh[NN];
    for (int r = 0; r < NN; ++r) deq32<FMT>(a.w + (n0 + r) * a.row_bytes, c, wl[r], wh[r]);
    for (int m = 0; m < MM; ++m) {
      const float* xp = a.x + m * a.x_stride + 32 * c;
      const F xl = fload(xp), xh = fload(xp + 16);
      for (int r = 0; r < NN; ++r) {  // lane j: k = 32c + j, then 32c + 16 + j
        acc[m][r] = ffma(xl, wl[r], acc[m][r]);
        acc[m][r] = ffma(xh, wh[r], acc[m][r]);
      }
    }
  }
  store_sums<MM, NN>(acc, a.y, a.y_stride, n0);
}

// Every weight row of the thread's range for exactly MM rows of x: tiles of fused_nr(MM) weight rows, then
// single rows. Which tile computes an output never changes its operations (each lane's fma sequence is fixed).
template <int FMT, int MM>
inline void fused_rows(const MatmulArgs& a) {
  constexpr int NN = fused_nr(MM);
  int64_t n = a.n_begin;
  for (; n + NN <= a.n_end; n += NN) fused_tile<FMT, MM, NN>(a, n);
  for (; n < a.n_end; ++n) fused_tile<FMT, MM, 1>(a, n);
}

// fused_rows for a.M rows, 1 <= a.M <= kSmallM (one instantiation per row count).
template <int FMT, int MM = kSmallM>
inline void fused_dispatch(const MatmulArgs& a) {
  if constexpr (MM >= 1) {
    if (a.M == MM) {
      fused_rows<FMT, MM>(a);
    } else {
      fused_dispatch<FMT, MM - 1>(a);
    }
  }
}

// y[m, n0 + r] for MM rows of x and NN dequantized rows w (each K floats, row stride K).
template <int MM, int NN>
inline void panel_tile(const float* x, int64_t x_stride, const float* w, int64_t K, float* y, int64_t y_stride,
                       int64_t n0) {
  F acc[MM][NN];
  for (int m = 0; m < MM; ++m)
    for (int r = 0; r < NN; ++r) acc[m][r] = fzero();
  for (int64_t k = 0; k < K; k += 16) {
    F wv[NN];
    for (int r = 0; r < NN; ++r) wv[r] = fload(w + r * K + k);
    for (int m = 0; m < MM; ++m) {
      const F xv = fload(x + m * x_stride + k);
      for (int r = 0; r < NN; ++r) acc[m][r] = ffma(xv, wv[r], acc[m][r]);
    }
  }
  store_sums<MM, NN>(acc, y, y_stride, n0);
}

template <int NN, int MM = kMR>
inline void panel_tail(const MatmulArgs& a, int64_t m0, int64_t rest, const float* w, int64_t n0) {
  if constexpr (MM > 0) {
    if (rest == MM) {
      panel_tile<MM, NN>(a.x + m0 * a.x_stride, a.x_stride, w, a.K, a.y + m0 * a.y_stride, a.y_stride, n0);
    } else {
      panel_tail<NN, MM - 1>(a, m0, rest, w, n0);
    }
  }
}

template <int NN>
inline void panel_rows(const MatmulArgs& a, int64_t m0, int64_t m1, const float* w, int64_t n0) {
  int64_t m = m0;
  for (; m + kMR <= m1; m += kMR)
    panel_tile<kMR, NN>(a.x + m * a.x_stride, a.x_stride, w, a.K, a.y + m * a.y_stride, a.y_stride, n0);
  if (m < m1) panel_tail<NN>(a, m, m1 - m, w, n0);
}

template <int FMT>
inline void dequant_row(const uint8_t* row, int64_t K, float* out) {
  for (int64_t c = 0; c < K / 32; ++c) {
    F lo, hi;
    deq32<FMT>(row, c, lo, hi);
    fstore(out + 32 * c, lo);
    fstore(out + 32 * c + 16, hi);
  }
}

template <int FMT>
void matmul_fmt(const MatmulArgs& a) {
  if (a.M <= kSmallM) {
    fused_dispatch<FMT>(a);
    return;
  }
  for (int64_t m0 = 0; m0 < a.M; m0 += kMB) {
    const int64_t m1 = a.M - m0 < kMB ? a.M : m0 + kMB;
    int64_t n = a.n_begin;
    while (n < a.n_end) {
      const int64_t nn = a.n_end - n >= kNR ? kNR : 1;
      for (int64_t r = 0; r < nn; ++r) dequant_row<FMT>(a.w + (n + r) * a.row_bytes, a.K, a.scratch + r * a.K);
      if (nn == kNR) {
        panel_rows<kNR>(a, m0, m1, a.scratch, n);
      } else {
        panel_rows<1>(a, m0, m1, a.scratch, n);
      }
      n += nn;
    }
  }
}

}  // namespace (the build's private helpers end here: the entry points below have linkage)

void matmul(const MatmulArgs& a) {  // qlinear.cpp refuses unknown formats before calling
  steady_fmt::with_format(a.fmt, [&]<steady_fmt::Traits T>() { matmul_fmt<T.ggml>(a); });
}

int64_t register_rows() { return kSmallM; }

void dequant_rows(int32_t fmt, const uint8_t* w, int64_t row_bytes, int64_t K, const int64_t* rows, int64_t num_rows,
                  float* out) {
  for (int64_t i = 0; i < num_rows; ++i) {
    const uint8_t* row = w + rows[i] * row_bytes;
    float* o = out + i * K;
    steady_fmt::with_format(fmt, [&]<steady_fmt::Traits T>() { dequant_row<T.ggml>(row, K, o); });
  }
}

void rms_norm(const float* x, int64_t x_stride, const float* weight, float eps, int64_t D, float* y, int64_t t0,
              int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const float* xr = x + t * x_stride;
    F acc = fzero();
    for (int64_t k = 0; k < D; k += 16) {
      const F v = fload(xr + k);
      acc = ffma(v, v, acc);
    }
    const float inv = 1.0f / std::sqrt(hsum(acc) / float(D) + eps);
    const F vi = fset1(inv);
    for (int64_t k = 0; k < D; k += 16) fstore(y + t * D + k, fmul(fmul(fload(xr + k), vi), fload(weight + k)));
  }
}

void silu_mul(const float* gu, int64_t I_, float* y, int64_t t0, int64_t t1) {
  const F one = fset1(1.0f);
  for (int64_t t = t0; t < t1; ++t) {
    const float* g = gu + t * 2 * I_;
    const float* u = g + I_;
    for (int64_t k = 0; k < I_; k += 16) {
      const F gv = fload(g + k);
      fstore(y + t * I_ + k, fmul(fdiv(gv, fadd(one, fexp(fsub(fzero(), gv)))), fload(u + k)));
    }
  }
}

// GELU (tanh approximation) · mul, as Gemma's MLP uses it: gelu(g) = 0.5 g (1 + tanh(u)) with
// u = sqrt(2/pi) (g + 0.044715 g^3). 0.5 (1 + tanh(u)) is exactly sigmoid(2u), so this computes
// g / (1 + exp(-2u)) with the same deterministic exp as silu_mul (libm's and Sleef's tanh may
// differ between machines and builds; this does not). Elementwise, so no reduction order.
void gelu_tanh_mul(const float* gu, int64_t I_, float* y, int64_t t0, int64_t t1) {
  const F one = fset1(1.0f), kappa = fset1(0.044715f), minus_two_beta = fset1(-1.5957691216057308f);
  for (int64_t t = t0; t < t1; ++t) {
    const float* g = gu + t * 2 * I_;
    const float* u = g + I_;
    for (int64_t k = 0; k < I_; k += 16) {
      const F gv = fload(g + k);
      const F inner = fmul(fadd(gv, fmul(kappa, fmul(fmul(gv, gv), gv))), minus_two_beta);  // -2u
      fstore(y + t * I_ + k, fmul(fdiv(gv, fadd(one, fexp(inner))), fload(u + k)));
    }
  }
}

// gpt-oss's clamped SwiGLU (transformers' GptOssExperts._apply_gate, on halves already de-interleaved at load):
// g = min(gate, limit), u = max(min(up, limit), -limit), y = (u + 1) * (g / (1 + exp(-(alpha g)))), the swish in
// silu_mul's form with the same deterministic exp. The clamps keep a NaN (minps returns its second operand where
// either is NaN, and the gate or up value is that operand). Elementwise, so no reduction order.
void swiglu_oai_mul(const float* gu, int64_t I_, float* y, int64_t t0, int64_t t1, float alpha, float limit) {
  const F one = fset1(1.0f), a = fset1(alpha), hi = fset1(limit), lo = fset1(-limit);
  for (int64_t t = t0; t < t1; ++t) {
    const float* g = gu + t * 2 * I_;
    const float* u = g + I_;
    for (int64_t k = 0; k < I_; k += 16) {
      const F gv = fmin(hi, fload(g + k));
      const F uv = fmax(lo, fmin(hi, fload(u + k)));
      const F swish = fdiv(gv, fadd(one, fexp(fsub(fzero(), fmul(gv, a)))));
      fstore(y + t * I_ + k, fmul(fadd(uv, one), swish));
    }
  }
}

// One pass for the row's maximum and whether it has a NaN, a second up to the maximum's first lane. A row with a
// NaN (never one log_softmax wrote from finite logits) takes the scalar loop, which is NumPy's definition.
void argmax(const float* x, int64_t V, int64_t* out, int64_t t0, int64_t t1) {
  const int64_t full = V - V % 16;
  for (int64_t t = t0; t < t1; ++t) {
    const float* xr = x + t * V;
    uint32_t nan = 0;
    float mx = -INFINITY;
    if (full) {
      F mv = fload(xr);
      nan |= fmask_nan(mv);
      for (int64_t k = 16; k < full; k += 16) {
        const F v = fload(xr + k);
        nan |= fmask_nan(v);
        mv = fmax(mv, v);
      }
      mx = hmax(mv);
    }
    for (int64_t k = full; k < V; ++k) {
      nan |= xr[k] != xr[k];
      mx = xr[k] > mx ? xr[k] : mx;
    }
    int64_t best = -1;
    if (nan) {
      best = 0;
      for (int64_t k = 0; k < V; ++k) {
        if (xr[k] != xr[k]) { best = k; break; }
        if (xr[k] > xr[best]) best = k;
      }
    } else {
      const F M = fset1(mx);
      for (int64_t k = 0; k < full && best < 0; k += 16) {
        const uint32_t hit = fmask_eq(fload(xr + k), M);
        if (hit) best = k + __builtin_ctz(hit);
      }
      for (int64_t k = full; k < V && best < 0; ++k) best = xr[k] == mx ? k : -1;
    }
    out[t] = best < 0 ? 0 : best;  // V = 0 has no maximum: 0, as an empty row's defined answer
  }
}

void log_softmax(const float* x, int64_t V, float* y, int64_t t0, int64_t t1) {
  const int64_t full = V - V % 16;
  for (int64_t t = t0; t < t1; ++t) {
    const float* xr = x + t * V;
    float* yr = y + t * V;
    float mx = -INFINITY;  // the max is exact in any order
    if (full) {
      F mv = fload(xr);
      for (int64_t k = 16; k < full; k += 16) mv = fmax(mv, fload(xr + k));
      mx = hmax(mv);
    }
    for (int64_t k = full; k < V; ++k) mx = xr[k] > mx ? xr[k] : mx;
    const F M = fset1(mx);
    F acc = fzero();  // lane j sums exp(x[k] - max) for k % 16 == j, ascending
    for (int64_t k = 0; k < full; k += 16) acc = fadd(acc, fexp(fsub(fload(xr + k), M)));
    if (full < V) {  // the tail's lanes; the lanes past V add exactly +0
      alignas(64) float tail[16];
      for (int i = 0; i < 16; ++i) tail[i] = full + i < V ? xr[full + i] : mx;
      fstore(tail, fexp(fsub(fload(tail), M)));
      for (int i = 0; i < 16; ++i) tail[i] = full + i < V ? tail[i] : 0.0f;
      acc = fadd(acc, fload(tail));
    }
    const F L = fset1(det_log(hsum(acc)));
    for (int64_t k = 0; k < full; k += 16) fstore(yr + k, fsub(fsub(fload(xr + k), M), L));
    if (full < V) {
      alignas(64) float tail[16];
      for (int i = 0; i < 16; ++i) tail[i] = full + i < V ? xr[full + i] : 0.0f;
      fstore(tail, fsub(fsub(fload(tail), M), L));
      for (int64_t k = full; k < V; ++k) yr[k] = tail[k - full];
    }
  }
}
