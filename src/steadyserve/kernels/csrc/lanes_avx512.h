// The AVX-512 build's lanes: 16 floats (F) or 16 int32 (I) are one zmm register, and a panel's 64 weight bytes (W)
// one more. The same names and meanings as lanes_scalar.h and lanes_avx2.h (that file documents each operation once).
//
// Included inside a kernel family's build namespace (qmm_avx512.cpp, q8_avx512.cpp, q8_amx.cpp,
// attention_avx512.cpp), after <immintrin.h>, half.h and the build's `#pragma GCC target` (AVX-512 F/BW/DQ/VL with
// AVX2, FMA and F16C; the int8 family's pragma adds AVX512_VNNI, which the integer products need). isa.h decides
// where the build runs; nothing here asks the CPU.

// ---- float lanes ----
using F = __m512;
inline F fzero() { return _mm512_setzero_ps(); }
inline F fset1(float v) { return _mm512_set1_ps(v); }
inline F fload(const float* p) { return _mm512_loadu_ps(p); }
inline void fstore(float* p, F v) { _mm512_storeu_ps(p, v); }
inline F ffma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
inline F fmul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F fadd(F a, F b) { return _mm512_add_ps(a, b); }
inline F fsub(F a, F b) { return _mm512_sub_ps(a, b); }
inline F fdiv(F a, F b) { return _mm512_div_ps(a, b); }
inline F fmax(F a, F b) { return _mm512_max_ps(a, b); }
inline F fmin(F a, F b) { return _mm512_min_ps(a, b); }
inline F fabs(F a) { return _mm512_abs_ps(a); }
inline F fneg(F a) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN))); }
inline F fzero_lt(F v, F x, float lim) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(lim), _CMP_NLT_UQ), v); }
inline float hsum(F v) {  // lanes i + 8, then + 4, + 2, + 1
  const __m256 lo = _mm512_castps512_ps256(v);
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  const __m256 s8 = _mm256_add_ps(lo, hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
inline void hsum4(F a, F b, F c, F d, float* out) {  // four of hsum's trees, packed four outputs to a register
  const F ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));  // l_i + l_{i+8}
  const F cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  const F q = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));  // + 4
  const F r = _mm512_add_ps(q, _mm512_permute_ps(q, 0x4E));  // + 2 (lanes 0, 1 of each 128-bit chunk)
  const F t = _mm512_add_ps(r, _mm512_permute_ps(r, 0xB1));  // + 1 (lane 0 of each chunk)
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, t);
  out[0] = lanes[0], out[1] = lanes[4], out[2] = lanes[8], out[3] = lanes[12];
}
inline float hmax(F v) { return _mm512_reduce_max_ps(v); }
inline void hmax4(F a, F b, F c, F d, float* out) {  // hsum4's shuffles with max: four maxima, one register
  const F ab = _mm512_max_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const F cd = _mm512_max_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  const F q = _mm512_max_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  const F r = _mm512_max_ps(q, _mm512_permute_ps(q, 0x4E));
  const F t = _mm512_max_ps(r, _mm512_permute_ps(r, 0xB1));
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, t);
  out[0] = lanes[0], out[1] = lanes[4], out[2] = lanes[8], out[3] = lanes[12];
}
inline uint32_t fmask_eq(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
inline uint32_t fmask_nan(F a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
inline bool fall_finite(F v) { return _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(FLT_MAX), _CMP_LE_OQ) == 0xFFFF; }

// ---- int32 lanes ----
using I = __m512i;
inline I izero() { return _mm512_setzero_si512(); }
inline I iset1(int32_t v) { return _mm512_set1_epi32(v); }
inline I ilanes() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
inline I iload(const int32_t* p) { return _mm512_loadu_si512(p); }
inline void istore(int32_t* p, I v) { _mm512_storeu_si512(p, v); }
inline I iload_u8(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline I iload_i8(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline I iload_u16(const uint8_t* p) { return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void istore_i8(int8_t* p, I v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v)); }
inline I iand(I a, int32_t m) { return _mm512_and_si512(a, _mm512_set1_epi32(m)); }
inline I isrl(I a, int n) { return _mm512_srli_epi32(a, unsigned(n)); }
inline I isll(I a, int n) { return _mm512_slli_epi32(a, unsigned(n)); }
inline I isrlv(I a, I n) { return _mm512_srlv_epi32(a, n); }
inline I ior(I a, I b) { return _mm512_or_si512(a, b); }
inline I isub(I a, I b) { return _mm512_sub_epi32(a, b); }
inline I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
inline int32_t ihsum(I a) { return _mm512_reduce_add_epi32(a); }
inline F i2f(I a) { return _mm512_cvtepi32_ps(a); }
inline I f2i(F a) { return _mm512_cvttps_epi32(a); }
inline I fround(F a) { return _mm512_cvtps_epi32(a); }
inline F ibits2f(I a) { return _mm512_castsi512_ps(a); }

// ---- binary16 ----
inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  return _cvtsh_ss(h);
}
inline F h2f(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void fstore_h(uint16_t* p, F v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

inline void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

// ---- int8 products (the int8 family; AVX512_VNNI) ----
using W = __m512i;
inline W wload(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline W wand(W w, int m) { return _mm512_and_si512(w, _mm512_set1_epi8(char(m))); }
inline W wsrl16(W w, int n) { return _mm512_srli_epi16(w, unsigned(n)); }
inline W wsll16(W w, int n) { return _mm512_slli_epi16(w, unsigned(n)); }
inline W wor(W a, W b) { return _mm512_or_si512(a, b); }
// Each byte (a value 0..15) replaced by table[byte] (vpshufb in each 128-bit lane, the table in all four).
inline W wlut16(W w, const uint8_t* table) {
  return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(table))), w);
}
// vpdpbusd sums straight into int32 lanes: the partial sums S are int32 already, all 8 quads of a block go into one,
// and widen is a plain add.
using S = __m512i;
template <int BITS>
constexpr int kSumRun = 8;
// Q8_0's signed weights go through vpdpbusd as w + 128 (unsigned): 128 times the sum of x comes off after.
constexpr int32_t kSignedBias = 128;
inline S szero() { return _mm512_setzero_si512(); }
template <int BITS>
inline S sdot(S acc, W w, int32_t x4) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x4)); }
inline S sdot_signed(S acc, W w, int32_t x4) {
  return _mm512_dpbusd_epi32(acc, _mm512_xor_si512(w, _mm512_set1_epi8(char(0x80))), _mm512_set1_epi32(x4));
}
inline I widen(I acc, S s) { return _mm512_add_epi32(acc, s); }
