// The attention and RoPE loops of one build, written once: attention_scalar.cpp, attention_avx2.cpp and
// attention_avx512.cpp each include this inside namespace steady_attn::<build>, after their target pragma, so the
// compiler vectorizes the same IEEE operations to that width (paged_attention.cpp's reduction order: every lane runs
// one element's sequence of operations, so the width changes speed, never bits; tests/test_attention_kernel.py runs
// every build the CPU has and compares). Every function here takes the Problem of attention.h.

// The next block's region of one kv head, requested into L2 while this block is read: a block region is its own
// page or two (4-8 KiB) wherever the block table put it, and the hardware prefetchers stop at page boundaries.
// A prefetch changes no value. The f16 cache (the default) does not take this burst: its conversion requests the
// next region a line per line converted (halves_block's `next`), and a tile's last V block requests the first K block
// of the unit its thread runs next. Issued in one burst, the 64 requests filled the core's line-fill buffers and the
// thread stalled on them (a third of attend_tile's samples sat on the prefetch loop); streamed, a c=64 decode step's
// attention over SmolLM2's 30 layers (96-token contexts) took 8.8-10.3 -> 7.0-8.3 ms (Intel Xeon, 2 threads).
inline void prefetch_region(const uint8_t* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

// Whether a pass over a block's keys takes 32 of them (else 16): W (the build and shape allow it), and for a q8_0
// cache only while the pass's TQ tokens' G rows keep their integer and float sums in registers (4 rows). A speed
// knob only: every score's chain is the same either way.
template <int F, int G, int TQ, bool W>
constexpr bool wide_scores() {
  return W && (F != steady_kv::kQ8 || G * TQ <= 4);
}

// Step 1 for N keys of one block from offset `off` (key c the first) and TQ tokens: score_keys over float queries
// (qf[t]: token t's G rows) and keys, or, for a q8_0 cache, score_keys_q8 over q8_0 queries (qq[t]).
template <int F, int G, int N, int TQ>
STEADY_INLINE void score_pass(const Problem& P, const float* const (&qf)[TQ], const uint8_t* const (&qq)[TQ],
                              const uint8_t* kh, int64_t off, int64_t c, const int64_t (&first)[TQ],
                              const int64_t (&pos)[TQ], float* const (&out)[TQ], int64_t stride) {
  if constexpr (F == steady_kv::kQ8) {
    score_keys_q8<G, N, TQ>(qq, kh, off, P.d, P.bs, c, first, pos, P.scale, P.softcap, out, stride);
  } else {
    score_keys<F, G, N, TQ>(qf, kh, off, P.d, P.bs, c, first, pos, P.scale, P.softcap, out, stride);
  }
}

// One (token, kv head): all G query heads of that kv head share each K and V load.
// `scores` holds G rows of `stride` floats; row r, index i is key c0 + i, where c0
// is `first` rounded down to a multiple of 16, so lanes sit at fixed absolute positions.
// W (wide) handles 32 keys and 64 dimensions per pass where the shapes allow; the
// arithmetic of every element is the same either way.
template <int F, int G, bool W>
void attend_one(const Problem& P, int64_t t, int64_t g, float* scores, int64_t stride) {
  const int64_t D = P.d, Bs = P.bs;
  const int64_t p = P.pos[t];
  const int64_t first = first_key(P, p);
  const int64_t c0 = first - first % kLanes;
  const int64_t* table = P.tables + P.seq_of[t] * P.nb_max;
  const float* qg = P.q + (t * P.h + g * G) * D;  // (G, D)
  // A q8_0 cache: the G rows in q8_0 blocks, after the scores in the caller's scratch (q8_row_bytes(D) each).
  uint8_t* const qq = reinterpret_cast<uint8_t*>(scores + G * stride);
  if constexpr (F == steady_kv::kQ8) quantize_query(qg, G, D, qq);

  // 1. Scores (a pass never straddles a block: Bs % 16 == 0).
  for (int64_t c = c0, blk = c0 / Bs, off = c0 % Bs, fetched = -1; c <= p;) {
    if (off == Bs) off = 0, ++blk;
    const uint8_t* kh = P.k + (table[blk] * P.hkv + g) * P.head_bytes;  // (D, Bs) of this block and kv head
    if (blk != fetched && (blk + 1) * Bs <= p) {  // once per block: the next one's region
      prefetch_region(P.k + (table[blk + 1] * P.hkv + g) * P.head_bytes, P.head_bytes);
      fetched = blk;
    }
    const int64_t firsts[1] = {first}, ps[1] = {p};
    float* const outs[1] = {scores + (c - c0)};
    if (wide_scores<F, G, 1, W>() && off + 2 * kLanes <= Bs && c + kLanes <= p) {
      score_pass<F, G, 2 * kLanes, 1>(P, {qg}, {qq}, kh, off, c, firsts, ps, outs, stride);
      c += 2 * kLanes, off += 2 * kLanes;
    } else {
      score_pass<F, G, kLanes, 1>(P, {qg}, {qq}, kh, off, c, firsts, ps, outs, stride);
      c += kLanes, off += kLanes;
    }
  }
  float total[G];
  softmax_rows<G>(scores, stride, (p - c0) / kLanes + 1, total, P.sinks ? P.sinks + g * G : nullptr);
  // 5. Weighted values over the attended keys, ascending, block by block; one lane per
  //    output dimension, NV dimensions per pass.
  constexpr int NV = W ? 4 * kLanes : kLanes;
  for (int64_t d0 = 0; d0 < D; d0 += NV) {
    float acc[G][NV] = {};
    float buf[NV];
    for (int64_t b = first / Bs; b * Bs <= p; ++b) {
      const uint8_t* vh = P.v + (table[b] * P.hkv + g) * P.head_bytes;  // (Bs, D) of this block and kv head
      if (d0 == 0 && (b + 1) * Bs <= p)  // the first pass over the blocks; later passes find them in cache
        prefetch_region(P.v + (table[b + 1] * P.hkv + g) * P.head_bytes, P.head_bytes);
      const int64_t k0 = b * Bs > first ? b * Bs : first, k1 = b * Bs + Bs - 1 < p ? b * Bs + Bs - 1 : p;
      for (int64_t key = k0; key <= k1; ++key) {
        const float* vr = v_row<F, NV>(vh, key - b * Bs, d0, D, buf);
        for (int r = 0; r < G; ++r) {
          const float e = scores[r * stride + (key - c0)];
          for (int l = 0; l < NV; ++l) acc[r][l] = std::fmaf(e, vr[l], acc[r][l]);
        }
      }
    }
    for (int r = 0; r < G; ++r) {
      float* o = P.out + (t * P.h + g * G + r) * D + d0;
      for (int l = 0; l < NV; ++l) o[l] = acc[r][l] / total[r];  // a division, not a reciprocal multiply
    }
  }
}


// How many tokens of a tile share one pass over a block's K or V rows (score_keys' and value_keys' TQ), for G query
// heads of N accumulator lanes each: as many as `budget` accumulator floats hold (the build's kScoreAccFloats or
// kValueAccFloats), at most 4. A kv head with few query heads has too few independent chains to hide the fma latency
// and too few fmas per row loaded; tokens of one tile add both. A speed knob only: each element's chain is the same
// for any TQ.
template <int G, int N, int budget>
constexpr int kTokensPerPass = budget / (G * N) >= 4 ? 4 : budget / (G * N) >= 1 ? budget / (G * N) : 1;

// The scores of tokens t .. t + TQ - 1 (rows starting at key c0, each token's G rows of `stride` floats, token k's
// at out + k * G * stride) against the keys of block b from c0 (or the block's start) up to the last token's
// position, in passes of 32 or 16 keys. A pass writes every key it covers: the score for keys in [first, p] of that
// token, -inf for the others (keys after p lie within the row's stride and are never read). kh: the block as floats,
// or its q8_0 region (F); qq: for q8_0, token t's G quantized rows (q8_row_bytes(D) each).
template <int F, int G, bool W, int TQ>
STEADY_INLINE void score_passes(const Problem& P, int64_t t, int64_t g, const uint8_t* kh, int64_t b, int64_t c0,
                                const int64_t* first, const int64_t* pos, float* out, int64_t stride,
                                const uint8_t* qq) {
  const int64_t D = P.d, Bs = P.bs;
  const float* qs[TQ];
  const uint8_t* qr[TQ];
  int64_t fs[TQ], ps[TQ];
  for (int k = 0; k < TQ; ++k) {
    qs[k] = P.q + ((t + k) * P.h + g * G) * D, fs[k] = first[k], ps[k] = pos[k];
    qr[k] = qq + k * G * q8_row_bytes(D);
  }
  constexpr int FK = F == steady_kv::kQ8 ? F : steady_kv::kF32;  // the tile converted any other format's keys
  const int64_t last = *std::max_element(ps, ps + TQ);
  int64_t c = std::max(c0, b * Bs);
  for (int64_t off = c - b * Bs; c <= last && off < Bs;) {
    float* os[TQ];
    for (int k = 0; k < TQ; ++k) os[k] = out + k * G * stride + (c - c0);
    if (wide_scores<F, G, TQ, W>() && off + 2 * kLanes <= Bs && c + kLanes <= last) {
      score_pass<FK, G, 2 * kLanes, TQ>(P, qs, qr, kh, off, c, fs, ps, os, stride);
      c += 2 * kLanes, off += 2 * kLanes;
    } else {
      score_pass<FK, G, kLanes, TQ>(P, qs, qr, kh, off, c, fs, ps, os, stride);
      c += kLanes, off += kLanes;
    }
  }
}

// Step 5 for keys [k0, k1] of one V block (floats (Bs, D), its first key `base`) and TQ tokens: for each token's G
// rows and each output element, acc = fma(e, v, acc) over the keys ascending. acc[t]: token t's (G, D) accumulators,
// parked in memory between blocks (stored and reloaded exactly); s[t][r * stride + key]: its row r's exponentials.
template <int G, int NV, int TQ>
STEADY_INLINE void value_keys(const float* vb, int64_t base, int64_t D, float* const (&acc_at)[TQ],
                              const float* const (&s)[TQ], int64_t stride, int64_t k0, int64_t k1) {
  for (int64_t d0 = 0; d0 < D; d0 += NV) {
    float a[TQ][G][NV];
    for (int t = 0; t < TQ; ++t)
      for (int r = 0; r < G; ++r) std::memcpy(a[t][r], acc_at[t] + r * D + d0, sizeof a[t][r]);
    for (int64_t key = k0; key <= k1; ++key) {
      const float* vr = vb + (key - base) * D + d0;
      for (int t = 0; t < TQ; ++t)
        for (int r = 0; r < G; ++r) {
          const float e = s[t][r * stride + key];
          for (int l = 0; l < NV; ++l) a[t][r][l] = std::fmaf(e, vr[l], a[t][r][l]);
        }
    }
    for (int t = 0; t < TQ; ++t)
      for (int r = 0; r < G; ++r) std::memcpy(acc_at[t] + r * D + d0, a[t][r], sizeof a[t][r]);
  }
}

// Tokens [t0, t1) of one sequence (a tile, t1 - t0 <= kTile) and kv head g: steps 1-5 for each token, as
// attend_one computes them, but with the blocks outermost, so each K and V block is read (and, for a
// stored format, turned into floats) once per tile instead of once per token. `scores`: (t1 - t0) * G rows
// of `stride` floats (token i's row r at (i * G + r) * stride, index c - c0 of token i for key c, as
// attend_one), then, for a q8_0 cache, the tile's (t1 - t0) * G quantized query rows; `acc`: (t1 - t0) * G * D
// floats; kf, vf: D * Bs floats each (one converted block).
template <int F, int G, bool W>
void attend_tile(const Problem& P, int64_t t0, int64_t t1, int64_t g, float* scores, int64_t stride, float* acc,
                 float* kf, float* vf, const uint8_t* after) {
  const int64_t D = P.d, Bs = P.bs, M = t1 - t0;
  const int64_t* table = P.tables + P.seq_of[t0] * P.nb_max;
  int64_t first[kTile], c0[kTile], pos[kTile];
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
  for (int64_t i = 0; i < M; ++i) {
    const int64_t p = P.pos[t0 + i];
    pos[i] = p;
    first[i] = first_key(P, p);
    c0[i] = first[i] - first[i] % kLanes;
    lo = std::min(lo, c0[i]);
    hi = std::max(hi, p);
  }
  uint8_t* const qq = reinterpret_cast<uint8_t*>(scores + M * G * stride);  // q8_0: token i's rows at i * G rows
  if constexpr (F == steady_kv::kQ8)
    for (int64_t i = 0; i < M; ++i) quantize_query(P.q + ((t0 + i) * P.h + g * G) * D, G, D, qq + i * G * q8_row_bytes(D));
  // 1. Scores, block by block (a pass never straddles a block: Bs % 16 == 0, c0 % 16 == 0).
  for (int64_t b = lo / Bs; b <= hi / Bs; ++b) {
    const uint8_t* kh = P.k + (table[b] * P.hkv + g) * P.head_bytes;  // (D, Bs) of this block and kv head
    // Read after this block: the next K block, else the tile's first V block.
    const uint8_t* next = b < hi / Bs ? P.k + (table[b + 1] * P.hkv + g) * P.head_bytes
                                      : P.v + (table[lo / Bs] * P.hkv + g) * P.head_bytes;
    if (F != steady_kv::kF16) prefetch_region(next, P.head_bytes);  // f16: streamed by the conversion
    if constexpr (F != steady_kv::kF32 && F != steady_kv::kQ8) {  // q8_0 keys stay integers (score_keys_q8)
      k_block_floats<F>(kh, D, Bs, kf, next);
      kh = reinterpret_cast<const uint8_t*>(kf);
    }
    int64_t i = 0;
    constexpr int TQ = kTokensPerPass<G, W ? 2 * kLanes : kLanes, kScoreAccFloats>;
    if constexpr (TQ > 1) {  // TQ tokens whose rows start at the same key share each pass
      for (; i + TQ <= M && std::all_of(c0 + i, c0 + i + TQ, [&](int64_t x) { return x == c0[i]; }); i += TQ)
        score_passes<F, G, W, TQ>(P, t0 + i, g, kh, b, c0[i], first + i, pos + i, scores + i * G * stride, stride,
                                  qq + i * G * q8_row_bytes(D));
    }
    for (; i < M; ++i)
      score_passes<F, G, W, 1>(P, t0 + i, g, kh, b, c0[i], first + i, pos + i, scores + i * G * stride, stride,
                               qq + i * G * q8_row_bytes(D));
  }
  // 2-4. Each token's softmax, as attend_one.
  float total[kTile][G];
  for (int64_t i = 0; i < M; ++i) softmax_rows<G>(scores + i * G * stride, stride, (pos[i] - c0[i]) / kLanes + 1, total[i],
                                                    P.sinks ? P.sinks + g * G : nullptr);
  // 5. Weighted values: per token and output element, fma over its attended keys ascending, block by block.
  constexpr int NV = W ? 4 * kLanes : kLanes;
  std::fill(acc, acc + M * G * D, 0.0f);
  for (int64_t b = lo / Bs; b <= hi / Bs; ++b) {  // c0[i] and first[i] lie in one block
    const uint8_t* vh = P.v + (table[b] * P.hkv + g) * P.head_bytes;  // (Bs, D) of this block and kv head
    // Read after this block: the next V block, else the first K block of the unit this thread runs next.
    const uint8_t* next = b < hi / Bs ? P.v + (table[b + 1] * P.hkv + g) * P.head_bytes : after;
    if (F != steady_kv::kF16 && next != nullptr) prefetch_region(next, P.head_bytes);
    if constexpr (F != steady_kv::kF32) {
      v_block_floats<F>(vh, D, Bs, vf, next);
      vh = reinterpret_cast<const uint8_t*>(vf);
    }
    const float* vb = reinterpret_cast<const float*>(vh);
    int64_t i = 0;
    constexpr int TQ = kTokensPerPass<G, NV, kValueAccFloats>;
    if constexpr (TQ > 1) {  // TQ tokens from the same first key share each V row
      for (; i + TQ <= M && std::all_of(first + i, first + i + TQ, [&](int64_t x) { return x == first[i]; }); i += TQ) {
        const int64_t k0 = std::max(b * Bs, first[i]);
        const int64_t k1 = std::min(b * Bs + Bs - 1, *std::min_element(pos + i, pos + i + TQ));
        float* as[TQ];
        const float* ss[TQ];
        for (int k = 0; k < TQ; ++k) as[k] = acc + (i + k) * G * D, ss[k] = scores + (i + k) * G * stride - c0[i + k];
        if (k0 <= k1) value_keys<G, NV, TQ>(vb, b * Bs, D, as, ss, stride, k0, k1);  // the keys all of them attend
        for (int k = 0; k < TQ; ++k) {  // then each token's own last keys, still ascending
          const int64_t own1 = std::min(b * Bs + Bs - 1, pos[i + k]);
          const int64_t own0 = std::max(k0, k1 + 1);
          if (own0 <= own1) value_keys<G, NV, 1>(vb, b * Bs, D, {as[k]}, {ss[k]}, stride, own0, own1);
        }
      }
    }
    for (; i < M; ++i) {
      const int64_t k0 = std::max(b * Bs, first[i]), k1 = std::min(b * Bs + Bs - 1, pos[i]);
      if (k0 > k1) continue;
      value_keys<G, NV, 1>(vb, b * Bs, D, {acc + i * G * D}, {scores + i * G * stride - c0[i]}, stride, k0, k1);
    }
  }
  for (int64_t i = 0; i < M; ++i)
    for (int r = 0; r < G; ++r) {
      float* o = P.out + ((t0 + i) * P.h + g * G + r) * D;
      const float* a = acc + (i * G + r) * D;
      for (int64_t dd = 0; dd < D; ++dd) o[dd] = a[dd] / total[i][r];  // a division, as attend_one
    }
}

// A lone token from an f16 cache takes the tile path: it converts each block once, in whole lines (halves_block), where
// attend_one converts row by row on 16 lanes (the same floats either way).
template <int F, int G, bool W>
constexpr AttendFn one_for() {
  if constexpr (F == steady_kv::kF16) {
    return nullptr;
  } else {
    return attend_one<F, G, W>;
  }
}

template <int F, bool W>
Kernels attend_for(int64_t group) {
#define STEADY_KERNELS(G) Kernels{one_for<F, G, W>(), attend_tile<F, G, W>}
  switch (group) {
    case 1: return STEADY_KERNELS(1);
    case 2: return STEADY_KERNELS(2);
    case 3: return STEADY_KERNELS(3);
    case 4: return STEADY_KERNELS(4);
    case 5: return STEADY_KERNELS(5);
    case 6: return STEADY_KERNELS(6);
    case 7: return STEADY_KERNELS(7);
    case 8: return STEADY_KERNELS(8);
    default: return Kernels{nullptr, nullptr};
  }
#undef STEADY_KERNELS
}

template <int F>
Kernels attend_for_fmt(int64_t group, bool wide) {
  if constexpr (kWidePasses) {
    if (wide) return attend_for<F, true>(group);
  }
  return attend_for<F, false>(group);
}

// The q8_0 cache's kernels (integer scores: attention_rows.h's score_keys_q8), compiled in this unit unless it names
// another's: the avx512 build's integer products need AVX512_VNNI, so attention_q8_avx512.cpp compiles them with it
// (STEADY_ATTN_Q8_ONLY, namespace avx512_q8) and attention_avx512.cpp calls that unit's (STEADY_ATTN_Q8_KERNELS);
// isa.h's best_attention() picks the avx512 build for a q8_0 cache only where the CPU has VNNI.
#ifndef STEADY_ATTN_Q8_KERNELS
Kernels attend_q8(int64_t group, bool wide) { return attend_for_fmt<steady_kv::kQ8>(group, wide); }
#define STEADY_ATTN_Q8_KERNELS attend_q8
#endif

#ifndef STEADY_ATTN_Q8_ONLY
// Wide passes need 32-key blocks and 64-dimension heads; other shapes take 16 at a time. A build without them
// (kWidePasses false: the scalar one) takes 16 at a time always, and compiles half the kernels; every element's
// arithmetic is the same either way, so its bits are the same.
Kernels attend_for_shape(int fmt, int64_t group, int64_t bs, int64_t d) {
  const bool wide = kWidePasses && bs % (2 * kLanes) == 0 && d % (4 * kLanes) == 0;
  switch (fmt) {
    case steady_kv::kF32: return attend_for_fmt<steady_kv::kF32>(group, wide);
    case steady_kv::kF16: return attend_for_fmt<steady_kv::kF16>(group, wide);
    case steady_kv::kBF16: return attend_for_fmt<steady_kv::kBF16>(group, wide);
    case steady_kv::kQ8: return STEADY_ATTN_Q8_KERNELS(group, wide);
    default: return Kernels{nullptr, nullptr};
  }
}

// x = tanh(x / cap) * cap in place, with softcap16: the same bits for an element wherever it sits.
void softcap_rows(float* x, int64_t n, float cap) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) softcap16(x + i, cap);
  if (i < n) {
    float tail[kLanes] = {};
    std::memcpy(tail, x + i, sizeof(float) * (n - i));
    softcap16(tail, cap);
    std::memcpy(x + i, tail, sizeof(float) * (n - i));
  }
}

// Rotates heads [0, num_heads) of each row of x in place. x: (T, >= num_heads * D) with
// unit column stride; cos, sin: (T, D) contiguous, the rows of each token's position.
void rope_rows(float* x, int64_t row_stride, const float* cos, const float* sin, int64_t t_begin, int64_t t_end,
               int64_t num_heads, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t t = t_begin; t < t_end; ++t) {
    const float* c = cos + t * D;
    const float* s = sin + t * D;
    for (int64_t h = 0; h < num_heads; ++h) {
      float* lo = x + t * row_stride + h * D;
      float* hi = lo + half;
      for (int64_t d = 0; d < half; ++d) {
        const float x1 = lo[d], x2 = hi[d];
        const float a = x1 * c[d], b = x2 * s[d];                 // rotate_half gives -x2 here
        const float e = x2 * c[d + half], f = x1 * s[d + half];   // and x1 here
        lo[d] = a - b;
        hi[d] = e + f;
      }
    }
  }
}


// The f16 cache's conversions on this build's lanes (attention_rows.h): every build gives the same bits.
void halves_to_floats(const uint16_t* h, float* out, int64_t n) { halves_block(h, out, n, nullptr); }
void floats_to_halves(const float* x, uint16_t* out, int64_t n) { floats_to_halves_n(x, out, n); }
#endif  // STEADY_ATTN_Q8_ONLY
