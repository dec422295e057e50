// The AVX2 build's lanes: 16 floats (F) or 16 int32 (I) are two ymm registers (lanes 0-7, 8-15), a panel's 64 weight
// bytes (W) two more. The same names and meanings as lanes_scalar.h and lanes_avx512.h (lanes_scalar.h documents
// each operation once).
//
// Included inside a kernel family's build namespace (qmm_avx2.cpp, q8_avx2.cpp, attention_avx2.cpp), after
// <immintrin.h>, half.h and the build's `#pragma GCC target("avx2,fma,f16c")`. isa.h decides where it runs.

// ---- float lanes ----
struct F {
  __m256 a, b;  // lanes 0-7, 8-15
};
inline F fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F fset1(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline F fload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void fstore(float* p, F v) { _mm256_storeu_ps(p, v.a); _mm256_storeu_ps(p + 8, v.b); }
inline F ffma(F x, F y, F z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
inline F fmul(F x, F y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
inline F fadd(F x, F y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
inline F fsub(F x, F y) { return {_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)}; }
inline F fdiv(F x, F y) { return {_mm256_div_ps(x.a, y.a), _mm256_div_ps(x.b, y.b)}; }
inline F fmax(F x, F y) { return {_mm256_max_ps(x.a, y.a), _mm256_max_ps(x.b, y.b)}; }
inline F fmin(F x, F y) { return {_mm256_min_ps(x.a, y.a), _mm256_min_ps(x.b, y.b)}; }
inline __m256 sign_bits() { return _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN)); }
inline F fabs(F x) { return {_mm256_andnot_ps(sign_bits(), x.a), _mm256_andnot_ps(sign_bits(), x.b)}; }
inline F fneg(F x) { return {_mm256_xor_ps(x.a, sign_bits()), _mm256_xor_ps(x.b, sign_bits())}; }
inline F fzero_lt(F v, F x, float lim) {
  const __m256 l = _mm256_set1_ps(lim);
  return {_mm256_and_ps(_mm256_cmp_ps(x.a, l, _CMP_NLT_UQ), v.a), _mm256_and_ps(_mm256_cmp_ps(x.b, l, _CMP_NLT_UQ), v.b)};
}
inline float hsum(F v) {  // lanes i + 8 (the two registers), then + 4, + 2, + 1
  const __m256 s8 = _mm256_add_ps(v.a, v.b);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
inline void hsum4(F a, F b, F c, F d, float* out) { out[0] = hsum(a), out[1] = hsum(b), out[2] = hsum(c), out[3] = hsum(d); }
inline float hmax(F v) {
  const __m256 m8 = _mm256_max_ps(v.a, v.b);
  const __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  const __m128 m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
}
inline void hmax4(F a, F b, F c, F d, float* out) { out[0] = hmax(a), out[1] = hmax(b), out[2] = hmax(c), out[3] = hmax(d); }
inline uint32_t fmask_eq(F x, F y) {
  return uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(x.a, y.a, _CMP_EQ_OQ))) |
         uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(x.b, y.b, _CMP_EQ_OQ))) << 8;
}
inline uint32_t fmask_nan(F x) {
  return uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(x.a, x.a, _CMP_UNORD_Q))) |
         uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(x.b, x.b, _CMP_UNORD_Q))) << 8;
}
inline bool fall_finite(F v) {
  const F a = fabs(v);
  const __m256 lim = _mm256_set1_ps(FLT_MAX);
  return _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(a.a, lim, _CMP_LE_OQ), _mm256_cmp_ps(a.b, lim, _CMP_LE_OQ))) == 0xFF;
}

// ---- int32 lanes ----
struct I {
  __m256i a, b;
};
inline I izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I iset1(int32_t v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
inline I ilanes() { return {_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)}; }
inline I iload(const int32_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8))};
}
inline void istore(int32_t* p, I v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v.a);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 8), v.b);
}
inline __m128i load8(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline I iload_u8(const uint8_t* p) { return {_mm256_cvtepu8_epi32(load8(p)), _mm256_cvtepu8_epi32(load8(p + 8))}; }
inline I iload_i8(const uint8_t* p) { return {_mm256_cvtepi8_epi32(load8(p)), _mm256_cvtepi8_epi32(load8(p + 8))}; }
inline I iload_u16(const uint8_t* p) { return {_mm256_cvtepu16_epi32(load16(p)), _mm256_cvtepu16_epi32(load16(p + 16))}; }
inline void istore_i8(int8_t* p, I v) {  // values in [-128, 127]: the saturating packs keep them
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(v.a, v.b), 0xD8);  // 16 int16 in order
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
}
inline I iand(I x, int32_t m) { const __m256i k = _mm256_set1_epi32(m); return {_mm256_and_si256(x.a, k), _mm256_and_si256(x.b, k)}; }
inline I isrl(I x, int n) { return {_mm256_srli_epi32(x.a, n), _mm256_srli_epi32(x.b, n)}; }
inline I isll(I x, int n) { return {_mm256_slli_epi32(x.a, n), _mm256_slli_epi32(x.b, n)}; }
inline I isrlv(I x, I n) { return {_mm256_srlv_epi32(x.a, n.a), _mm256_srlv_epi32(x.b, n.b)}; }
inline I ior(I x, I y) { return {_mm256_or_si256(x.a, y.a), _mm256_or_si256(x.b, y.b)}; }
inline I isub(I x, I y) { return {_mm256_sub_epi32(x.a, y.a), _mm256_sub_epi32(x.b, y.b)}; }
inline I iadd(I x, I y) { return {_mm256_add_epi32(x.a, y.a), _mm256_add_epi32(x.b, y.b)}; }
inline int32_t ihsum(I x) {
  alignas(32) int32_t l[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(l), _mm256_add_epi32(x.a, x.b));
  int32_t sum = 0;
  for (int i = 0; i < 8; ++i) sum += l[i];
  return sum;
}
inline F i2f(I x) { return {_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
inline I f2i(F x) { return {_mm256_cvttps_epi32(x.a), _mm256_cvttps_epi32(x.b)}; }
inline I fround(F x) { return {_mm256_cvtps_epi32(x.a), _mm256_cvtps_epi32(x.b)}; }
inline F ibits2f(I x) { return {_mm256_castsi256_ps(x.a), _mm256_castsi256_ps(x.b)}; }

// ---- binary16 ----
inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return _cvtsh_ss(h);
}
inline F h2f(const uint8_t* p) { return {_mm256_cvtph_ps(load16(p)), _mm256_cvtph_ps(load16(p + 16))}; }
inline void fstore_h(uint16_t* p, F v) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v.a, kNearest));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(v.b, kNearest));
}

inline void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

// ---- int8 products (the int8 family) ----
// Maddubs (unsigned weight x signed activation byte pairs into int16) and madd (int16 pairs into int32). Nothing
// saturates: the bounds are in q8_pack.cpp; Q8_0's signed weights use the sign trick (|w| times x with w's sign).
struct W {
  __m256i a, b;  // panel rows 0-7, 8-15: 4 bytes each
};
inline __m256i bytes(int m) { return _mm256_set1_epi8(char(m)); }
inline W wload(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline W wand(W w, int m) { return {_mm256_and_si256(w.a, bytes(m)), _mm256_and_si256(w.b, bytes(m))}; }
inline W wsrl16(W w, int n) { return {_mm256_srli_epi16(w.a, n), _mm256_srli_epi16(w.b, n)}; }
inline W wsll16(W w, int n) { return {_mm256_slli_epi16(w.a, n), _mm256_slli_epi16(w.b, n)}; }
inline W wor(W x, W y) { return {_mm256_or_si256(x.a, y.a), _mm256_or_si256(x.b, y.b)}; }
// Each byte (a value 0..15) replaced by table[byte] (vpshufb in each 128-bit half, the table in both).
inline W wlut16(W w, const uint8_t* table) {
  const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table)));
  return {_mm256_shuffle_epi8(t, w.a), _mm256_shuffle_epi8(t, w.b)};
}
// Partial sums in int16 lanes (two per panel row): maddubs adds each pair of u8 x s8 products into one, and up to
// kSumRun<BITS> quads' maddubs results add up in int16 before one madd (by ones) widens them to int32. maddubs and
// madd both run on the vector multiplier (one port on AMD Zen 1 and 2), so widening once per run, not once per quad,
// nearly halves that port's work for 4-bit weights. Bounds (|x| <= 127): a pair sum is at most 2 * (2^BITS - 1) * 127:
// 3810, 7874, 16002 for 4, 5, 6 bits, so 8, 4, 2 of them: 30480, 31496, 32004 <= 32767; Q8_0 through the sign trick
// (|w| <= 128): 2 * 128 * 127 = 32512, one. Nothing saturates (maddubs's own pair sums included), so every sum is
// exact and its grouping changes no value.
struct S {
  __m256i a, b;  // int16 lanes: panel rows 0-7, 8-15, two lanes per row
};
template <int BITS>
constexpr int kSumRun = BITS == 4 ? 8 : BITS == 5 ? 4 : BITS == 6 ? 2 : 1;
constexpr int32_t kSignedBias = 0;  // the sign trick forms sum w x directly
inline S szero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
// One vpaddw that GCC cannot reassociate. Written as +, a run of 8 quads' sums over a tile's 4 rows becomes a tree
// whose 64 products are spilled to the stack first (16 ymm registers), and a ymm store costs Zen 1 two cycles (the
// measurement: benchmarks/RESULTS.md, "Kernel tuning measurements"). Q6_K's runs of 2 were slower that way, so they
// keep the + (integer sums: either way the same value).
inline __m256i add16_in_order(__m256i a, __m256i b) {
  __m256i r;
  asm("vpaddw %2, %1, %0" : "=x"(r) : "x"(a), "xm"(b));
  return r;
}
template <int BITS>
inline __m256i add16(__m256i a, __m256i b) {
  if constexpr (kSumRun<BITS> >= 4) return add16_in_order(a, b);
  return _mm256_add_epi16(a, b);
}
template <int BITS>
inline S sdot(S s, W w, int32_t x4) {
  const __m256i x = _mm256_set1_epi32(x4);
  return {add16<BITS>(s.a, _mm256_maddubs_epi16(w.a, x)), add16<BITS>(s.b, _mm256_maddubs_epi16(w.b, x))};
}
inline S sdot_signed(S s, W w, int32_t x4) {
  const __m256i x = _mm256_set1_epi32(x4);
  return {_mm256_add_epi16(s.a, _mm256_maddubs_epi16(_mm256_abs_epi8(w.a), _mm256_sign_epi8(x, w.a))),
          _mm256_add_epi16(s.b, _mm256_maddubs_epi16(_mm256_abs_epi8(w.b), _mm256_sign_epi8(x, w.b)))};
}
inline I widen(I acc, S s) {
  const __m256i ones = _mm256_set1_epi16(1);
  return {_mm256_add_epi32(acc.a, _mm256_madd_epi16(s.a, ones)), _mm256_add_epi32(acc.b, _mm256_madd_epi16(s.b, ones))};
}
