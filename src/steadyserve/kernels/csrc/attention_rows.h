// The per-row pieces of paged attention (paged_attention.cpp): the exponential, the exact conversions of
// stored K/V values to floats, the score chains and the softmax sums, each written once for every build.
//
// The reduction order they implement is the one at the top of paged_attention.cpp; here, per piece:
//   - score_keys: step 1, score = s_D * scale with s_{d+1} = fma(q[d], k[d], s_d), d ascending, per key;
//   - quantize_query / score_keys_q8: step 1 over a q8_0 cache: the query in q8_0 blocks, exact integer block sums,
//     one float chain over the blocks (paged_attention.cpp, step 1');
//   - softmax_rows: steps 2-4, the max (exact in any order), exp_det16 (IEEE mul/add only), and the sum over 16
//     lanes (lane i: keys j % 16 == i in ascending j) closed by one fixed pairwise tree;
//   - k_row / v_row / halves16 / k_block_floats / v_block_floats: a stored f16 or bf16 key, or an f16, bf16 or
//     q8_0 value, becomes the float it stands for exactly (kv_format.h), so no order is involved.
// Every lane runs the same IEEE operations on one element, so the vector width never changes a bit. Written over the
// lanes (lanes_scalar.h names them) and included by each build's translation unit inside its namespace, after its lanes
// header (attention_scalar.cpp, _avx2.cpp, _avx512.cpp), in an anonymous namespace: each unit compiles its own copy
// for its width and no two copies meet at link time.

#include "lanes_math.h"

#define STEADY_INLINE __attribute__((always_inline)) inline  // inlined into its caller, so built for its ISA

// x[i] = exp(x[i] - m) for 16 lanes, in place, from IEEE add/sub/mul only (lanes_math.h) for x - m <= 0;
// x - m < -87 gives 0, so a masked score (-inf) contributes an exact zero. A NaN lane stays NaN (fmax returns its
// second operand where either is NaN, and fzero_lt keeps it).
STEADY_INLINE void exp_det16(float* x, float m) {
  const F in = fsub(fload(x), fset1(m));
  fstore(x, fzero_lt(fexp_bounded(fmax(fset1(-87.0f), in)), in, -87.0f));
}

// 16 binary16 values -> floats, exactly (the lanes' h2f: F16C's vcvtph2ps in the vector builds, half.h's bit moves in
// the scalar one; the same floats, NaNs quieted alike).
STEADY_INLINE void halves16(const uint16_t* h, float* out) { fstore(out, h2f(reinterpret_cast<const uint8_t*>(h))); }

// n binary16 values -> floats, exactly, for a whole stored block (k_block_floats, v_block_floats). `next` (or null): a
// region of at least 2 n bytes read after this one; line i of it is requested as line i of `h` is read, so the next
// block streams in while this one converts instead of in one burst that stalls the thread.
inline void halves_block(const uint16_t* h, float* out, int64_t n, const uint8_t* next) {
  int64_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {  // one 64-byte line of halves
    if (next != nullptr) __builtin_prefetch(next + 2 * i, 0, 2);
    halves16(h + i, out + i);
    halves16(h + i + kLanes, out + i + kLanes);
  }
  for (; i + kLanes <= n; i += kLanes) halves16(h + i, out + i);
  for (; i < n; ++i) out[i] = steady_num::half_to_float(h[i]);
}

// n floats -> binary16, round to nearest even (the f16 cache's write): the lanes' fstore_h, 16 at a time; a group of
// 16 with a NaN goes through half.h's float_to_half, whose NaN is the one quiet NaN (F16C would keep the payload's top).
inline void floats_to_halves_n(const float* x, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const F v = fload(x + i);
    if (fmask_nan(v) == 0) {
      fstore_h(out + i, v);
    } else {
      for (int l = 0; l < kLanes; ++l) out[i + l] = steady_num::float_to_half(x[i + l]);
    }
  }
  for (; i < n; ++i) out[i] = steady_num::float_to_half(x[i]);
}

// x[i] = tanh(x[i] / cap) * cap for 16 lanes (Gemma 2's soft-capping), from IEEE operations only:
// tanh|t| = (1 - e) / (1 + e) with e = exp(-2|t|) <= 1, the sign restored exactly. Elementwise.
STEADY_INLINE void softcap16(float* x, float cap) {
  float t[kLanes], e[kLanes];
  for (int l = 0; l < kLanes; ++l) {
    t[l] = x[l] / cap;
    e[l] = -2.0f * std::fabs(t[l]);
  }
  exp_det16(e, 0.0f);
  for (int l = 0; l < kLanes; ++l) {
    const float th = (1.0f - e[l]) / (1.0f + e[l]);
    x[l] = (t[l] < 0.0f ? -th : th) * cap;
  }
}

// Row dd of a K block region `kh` (D, Bs), keys [off, off + N), as floats: the stored floats themselves for
// float32, else converted exactly into `buf` (kv_format.h). A q8_0 cache's keys are never floats (score_keys_q8).
template <int F, int N>
STEADY_INLINE const float* k_row(const uint8_t* kh, int64_t dd, int64_t off, int64_t Bs, float* buf) {
  using namespace steady_kv;
  static_assert(F != kQ8, "q8_0 keys are read by score_keys_q8");
  if constexpr (F == kF32) {
    return reinterpret_cast<const float*>(kh) + dd * Bs + off;
  } else if constexpr (F == kF16) {
    const uint16_t* hv = reinterpret_cast<const uint16_t*>(kh) + dd * Bs + off;
    for (int c = 0; c < N; c += kLanes) halves16(hv + c, buf + c);
  } else {
    const uint16_t* hv = reinterpret_cast<const uint16_t*>(kh) + dd * Bs + off;
    for (int l = 0; l < N; ++l) buf[l] = bf16_to_f32(hv[l]);
  }
  return buf;
}

// Step 1's end for TQ tokens' G rows of N keys (key0 the first): out[t][r * stride + i] = s[t][r][i] * scale (then
// soft-capped, Gemma 2), or -inf for keys outside [first[t], p[t]].
template <int G, int N, int TQ>
STEADY_INLINE void store_scores(float (&s)[TQ][G][N], int64_t key0, const int64_t (&first)[TQ], const int64_t (&p)[TQ],
                                float scale, float softcap, float* const (&out)[TQ], int64_t stride) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int t = 0; t < TQ; ++t) {
    if (softcap > 0.0f) {
      for (int r = 0; r < G; ++r) {
        for (int l = 0; l < N; ++l) s[t][r][l] = s[t][r][l] * scale;
        for (int c = 0; c < N; c += kLanes) softcap16(&s[t][r][c], softcap);
        for (int l = 0; l < N; ++l) {
          const int64_t j = key0 + l;
          out[t][r * stride + l] = (j >= first[t] && j <= p[t]) ? s[t][r][l] : neg_inf;
        }
      }
      continue;
    }
    const bool inside = key0 >= first[t] && key0 + N - 1 <= p[t];  // every key counts: no mask (most passes)
    for (int r = 0; r < G; ++r) {
      if (inside) {
        for (int c = 0; c < N; c += kLanes) fstore(&out[t][r * stride + c], fmul(fload(&s[t][r][c]), fset1(scale)));
        continue;
      }
      for (int l = 0; l < N; ++l) {
        const int64_t j = key0 + l;
        out[t][r * stride + l] = (j >= first[t] && j <= p[t]) ? s[t][r][l] * scale : neg_inf;
      }
    }
  }
}

// Scores of N consecutive keys of one block (N a multiple of 16) for G query heads of each of TQ tokens:
// out[t][r * stride + i] = (sum over d ascending of q_{t,r}[d] * k_i[d]) * scale, or -inf for keys outside
// [first[t], p[t]]. More keys or tokens per pass only mean more independent chains sharing each K row (TQ tokens of
// one head: an MHA model's G = 1 has too few chains to hide the fma latency alone); every element's chain is the
// same. kh: the block's K region of this kv head, as floats (F float32) or in format F; off: the first key's offset.
template <int F, int G, int N, int TQ = 1>
STEADY_INLINE void score_keys(const float* const (&qg)[TQ], const uint8_t* kh, int64_t off, int64_t D, int64_t Bs,
                              int64_t key0, const int64_t (&first)[TQ], const int64_t (&p)[TQ], float scale,
                              float softcap, float* const (&out)[TQ], int64_t stride) {
  float s[TQ][G][N] = {};
  float buf[N];
  for (int64_t dd = 0; dd < D; ++dd) {
    const float* kr = k_row<F, N>(kh, dd, off, Bs, buf);
    for (int t = 0; t < TQ; ++t)
      for (int r = 0; r < G; ++r) {
        const float qv = qg[t][r * D + dd];
        for (int l = 0; l < N; ++l) s[t][r][l] = std::fmaf(qv, kr[l], s[t][r][l]);
      }
  }
  store_scores<G, N, TQ>(s, key0, first, p, scale, softcap, out, stride);
}

// A query row in q8_0 blocks, as score_keys_q8 reads it: D int8 values, then D/32 float32 scales, then D/32 int32
// terms -kSignedBias x the sum of each block's values: the build's offset (0 where its products are signed), which
// starts the block's integer chains, computed once per row rather than multiplied and moved across per pass.
// q8_row_bytes(D) in attention.h.
struct QRow {
  const int8_t* q;
  const float* d;
  const int32_t* zero;
};
STEADY_INLINE QRow q8_row(const uint8_t* base, int64_t D) {
  return {reinterpret_cast<const int8_t*>(base), reinterpret_cast<const float*>(base + D),
          reinterpret_cast<const int32_t*>(base + D + D / 8)};
}

// n query rows of D floats (row i at x + i * D) into q8_0 rows at out + i * q8_row_bytes(D): each block of 32
// values by kv_format.h's rule with its scale kept as a float (quantize_q8_block). A row depends on itself alone.
inline void quantize_query(const float* x, int64_t n, int64_t D, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    uint8_t* base = out + i * q8_row_bytes(D);
    int8_t* q = reinterpret_cast<int8_t*>(base);
    for (int64_t c = 0; c < D / steady_kv::kQBlock; ++c) {
      const float d = steady_kv::quantize_q8_block(x + i * D + c * steady_kv::kQBlock, q + c * steady_kv::kQBlock);
      int32_t sum = 0;
      for (int64_t l = 0; l < steady_kv::kQBlock; ++l) sum += q[c * steady_kv::kQBlock + l];
      const int32_t zero = -kSignedBias * sum;  // QRow's zero
      std::memcpy(base + D + 4 * c, &d, 4);
      std::memcpy(base + D + D / 8 + 4 * c, &zero, 4);
    }
  }
}

// Step 1' (a q8_0 cache) for N consecutive keys of one block and G query rows of each of TQ tokens: per block c of
// 32 dims, I_c = the exact integer dot product of the query's and the key's int8 values (the build's sdot_signed over
// the 8 quads of dims, in int32: |I_c| <= 32 * 127 * 127 < 2^24, so float(I_c) is exact), then
// s_{c+1} = fma(float(I_c), dq_c * dk_c, s_c), c ascending (dq_c * dk_c one rounded product); score = s * scale, as
// store_scores. qrows[t]: token t's G rows (q8_row_bytes(D) apart); kh: the block's q8_0 K region (kv_format.h).
template <int G, int N, int TQ>
STEADY_INLINE void score_keys_q8(const uint8_t* const (&qrows)[TQ], const uint8_t* kh, int64_t off, int64_t D,
                                 int64_t Bs, int64_t key0, const int64_t (&first)[TQ], const int64_t (&p)[TQ],
                                 float scale, float softcap, float* const (&out)[TQ], int64_t stride) {
  constexpr int NL = N / kLanes;
  const int64_t rb = q8_row_bytes(D);
  F s[TQ][G][NL];
  for (int t = 0; t < TQ; ++t)
    for (int r = 0; r < G; ++r)
      for (int n = 0; n < NL; ++n) s[t][r][n] = fzero();
  const uint16_t* scales = reinterpret_cast<const uint16_t*>(kh + D * Bs);
  for (int64_t c = 0; c < D / steady_kv::kQBlock; ++c) {
    I acc[TQ][G][NL];  // each starts at its row's offset term (QRow's zero)
    S part[TQ][G][NL];
    for (int t = 0; t < TQ; ++t)
      for (int r = 0; r < G; ++r) {
        const I zero = iset1(q8_row(qrows[t] + r * rb, D).zero[c]);
        for (int n = 0; n < NL; ++n) acc[t][r][n] = zero, part[t][r][n] = szero();
      }
    for (int a = 0; a < 8; ++a) {  // quads of dims 32 c + 4 a .. + 3, ascending (any order: integer sums)
      const int64_t dd = c * steady_kv::kQBlock + 4 * a;
      W w[NL];
      for (int n = 0; n < NL; ++n) w[n] = wload(kh + steady_kv::k_q8_at(dd, off + n * kLanes, Bs));
      for (int t = 0; t < TQ; ++t)
        for (int r = 0; r < G; ++r) {
          int32_t x4;
          std::memcpy(&x4, qrows[t] + r * rb + dd, 4);
          for (int n = 0; n < NL; ++n) part[t][r][n] = sdot_signed(part[t][r][n], w[n], x4);
        }
      if ((a + 1) % kSumRun<8> == 0)
        for (int t = 0; t < TQ; ++t)
          for (int r = 0; r < G; ++r)
            for (int n = 0; n < NL; ++n) acc[t][r][n] = widen(acc[t][r][n], part[t][r][n]), part[t][r][n] = szero();
    }
    F dk[NL];
    for (int n = 0; n < NL; ++n) dk[n] = h2f(reinterpret_cast<const uint8_t*>(scales + c * Bs + off + n * kLanes));
    for (int t = 0; t < TQ; ++t)
      for (int r = 0; r < G; ++r) {
        const F dq = fset1(q8_row(qrows[t] + r * rb, D).d[c]);
        for (int n = 0; n < NL; ++n) s[t][r][n] = ffma(i2f(acc[t][r][n]), fmul(dq, dk[n]), s[t][r][n]);
      }
  }
  float sf[TQ][G][N];
  for (int t = 0; t < TQ; ++t)
    for (int r = 0; r < G; ++r)
      for (int n = 0; n < NL; ++n) fstore(&sf[t][r][n * kLanes], s[t][r][n]);
  store_scores<G, N, TQ>(sf, key0, first, p, scale, softcap, out, stride);
}

// Values [d0, d0 + NV) of row `row` of a V block region `vh` (Bs, D), as floats (as k_row).
template <int F, int NV>
STEADY_INLINE const float* v_row(const uint8_t* vh, int64_t row, int64_t d0, int64_t D, float* buf) {
  using namespace steady_kv;
  if constexpr (F == kF32) {
    return reinterpret_cast<const float*>(vh) + row * D + d0;
  } else if constexpr (F == kQ8) {
    const int8_t* qv = reinterpret_cast<const int8_t*>(vh) + row * (D + D / 16);
    const uint16_t* sc = reinterpret_cast<const uint16_t*>(qv + D);
    for (int c = 0; c < NV; c += kLanes) {  // 16 dims share one scale: d0 and NV are multiples of 16
      const float d = half_to_float(sc[(d0 + c) / kQBlock]);
      fstore(buf + c, fmul(i2f(iload_i8(reinterpret_cast<const uint8_t*>(qv + d0 + c))), fset1(d)));  // float(q) * d
    }
  } else if constexpr (F == kF16) {
    const uint16_t* hv = reinterpret_cast<const uint16_t*>(vh) + row * D + d0;
    for (int c = 0; c < NV; c += kLanes) halves16(hv + c, buf + c);
  } else {
    const uint16_t* hv = reinterpret_cast<const uint16_t*>(vh) + row * D + d0;
    for (int l = 0; l < NV; ++l) buf[l] = bf16_to_f32(hv[l]);
  }
  return buf;
}

// Steps 2-4 for G score rows of `stride` floats, n_chunks 16-key chunks each: exponentials in place,
// total[r] = row r's sum. Shared by the untiled and the tiled loop, so both run the same operations.
// sinks (or null): row r's attention-sink logit (gpt-oss), a score with no value: it joins the max, and its
// exponential, computed by the same exp_det16 as any score, is added to the lane tree's sum last.
template <int G>
STEADY_INLINE void softmax_rows(float* scores, int64_t stride, int64_t n_chunks, float* total, const float* sinks) {
  for (int r = 0; r < G; ++r) {
    float* sr = scores + r * stride;
    // 2. Max (exact in any order), as 16 lanes.
    F mv = fset1(-std::numeric_limits<float>::infinity());
    for (int64_t c = 0; c < n_chunks; ++c) mv = fmax(fload(sr + c * kLanes), mv);  // x > mv ? x : mv
    float mlane[kLanes];
    fstore(mlane, mv);
    float m = mlane[0];
    for (int l = 1; l < kLanes; ++l) m = mlane[l] > m ? mlane[l] : m;
    if (sinks != nullptr) m = sinks[r] > m ? sinks[r] : m;
    // 3-4. Exponentials in place (masked keys give exact zeros), summed in 16 lanes: lane l adds its keys in
    // ascending c. Written on the lanes, because GCC left the array form as 16 scalar adds per chunk (11% of
    // a 2k-token prefill's attention).
    F acc = fzero();
    for (int64_t c = 0; c < n_chunks; ++c) {
      exp_det16(sr + c * kLanes, m);
      acc = fadd(acc, fload(sr + c * kLanes));
    }
    float lane[kLanes];
    fstore(lane, acc);
    float l8[8], l4[4], l2[2];
    for (int i = 0; i < 8; ++i) l8[i] = lane[2 * i] + lane[2 * i + 1];
    for (int i = 0; i < 4; ++i) l4[i] = l8[2 * i] + l8[2 * i + 1];
    for (int i = 0; i < 2; ++i) l2[i] = l4[2 * i] + l4[2 * i + 1];
    total[r] = l2[0] + l2[1];
    if (sinks != nullptr) {  // the sink's exponential in lane 0 of a chunk whose other lanes are masked
      alignas(64) float sink[kLanes];
      sink[0] = sinks[r];
      for (int l = 1; l < kLanes; ++l) sink[l] = -std::numeric_limits<float>::infinity();
      exp_det16(sink, m);
      total[r] = total[r] + sink[0];
    }
  }
}

// A whole K block region `kh` (D, Bs) of format F as floats (D, Bs) in `out`, each value exactly as k_row
// reads it. Not called for float32, whose blocks are read in place, nor q8_0, whose keys stay integers.
template <int F>
STEADY_INLINE void k_block_floats(const uint8_t* kh, int64_t D, int64_t Bs, float* out, const uint8_t* next) {
  if constexpr (F == steady_kv::kF16) {  // (D, Bs) halves in a row: one conversion of the region
    halves_block(reinterpret_cast<const uint16_t*>(kh), out, D * Bs, next);
    return;
  }
  for (int64_t off = 0; off < Bs; off += kLanes)
    for (int64_t dd = 0; dd < D; ++dd) k_row<F, kLanes>(kh, dd, off, Bs, out + dd * Bs + off);
}

// A whole V block region `vh` (Bs, D) of format F as floats (Bs, D) in `out`, each value exactly as v_row
// reads it.
template <int F>
STEADY_INLINE void v_block_floats(const uint8_t* vh, int64_t D, int64_t Bs, float* out, const uint8_t* next) {
  if constexpr (F == steady_kv::kF16) {  // (Bs, D) halves in a row
    halves_block(reinterpret_cast<const uint16_t*>(vh), out, D * Bs, next);
    return;
  }
  for (int64_t row = 0; row < Bs; ++row)
    for (int64_t d0 = 0; d0 < D; d0 += kLanes) v_row<F, kLanes>(vh, row, d0, D, out + row * D + d0);
}
