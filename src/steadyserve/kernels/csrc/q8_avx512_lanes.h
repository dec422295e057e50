// The AVX-512 lanes of the int8 family (q8_body.h's abstraction): a panel's 16 rows are the 16 lanes of one zmm
// register and vpdpbusd forms the integer sums. Included inside namespace steady_q8::<build>::(anonymous) by the
// two builds that run on AVX-512 VNNI: q8_avx512.cpp and q8_amx.cpp (whose tiles' epilogue uses the same lanes),
// after <immintrin.h> and their target pragma.

using W = __m512i;
using I = __m512i;
using F = __m512;

// Activation rows per tile: 8 accumulators, 8 weight operands and the block's constants fit in 32 zmm.
constexpr int kMM = 8;
// Q8_0's signed weights go through vpdpbusd as w + 128 (unsigned): 128 times the sum of x comes off after.
constexpr int32_t kSignedBias = 128;

inline W wload(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline W wand(W w, int m) { return _mm512_and_si512(w, _mm512_set1_epi8(char(m))); }
inline W wsrl16(W w, int n) { return _mm512_srli_epi16(w, unsigned(n)); }
inline W wsll16(W w, int n) { return _mm512_slli_epi16(w, unsigned(n)); }
inline W wor(W a, W b) { return _mm512_or_si512(a, b); }
inline I izero() { return _mm512_setzero_si512(); }
// vpdpbusd sums straight into int32 lanes: the partial sums S are int32 already, all 8 quads of a block go into one,
// and widen is a plain add (of the tile's zero, which the compiler drops).
using S = __m512i;
template <int BITS>
constexpr int kSumRun = 8;
inline S szero() { return _mm512_setzero_si512(); }
template <int BITS>  // the weights' bits: a build may add differently per format (AVX2 does)
inline S sdot(S acc, W w, int32_t x4) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x4)); }
inline S sdot_signed(S acc, W w, int32_t x4) {
  return _mm512_dpbusd_epi32(acc, _mm512_xor_si512(w, _mm512_set1_epi8(char(0x80))), _mm512_set1_epi32(x4));
}
inline I widen(I acc, S s) { return _mm512_add_epi32(acc, s); }
inline I isub_bcast(I a, int32_t v) { return _mm512_sub_epi32(a, _mm512_set1_epi32(v)); }
inline I i8load(const uint8_t* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline F f_of_i(I a) { return _mm512_cvtepi32_ps(a); }  // round to nearest even, as float(int) in C++
inline F fmul_bcast(F a, float s) { return _mm512_mul_ps(a, _mm512_set1_ps(s)); }
inline F fzero() { return _mm512_setzero_ps(); }
inline F fmul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F fneg(F a) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN))); }
inline F h2f16(const uint8_t* p) {  // exact, as half.h's conversion
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline F u8f(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline F ffma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
inline F ffma_bcast(F a, float s, F c) { return _mm512_fmadd_ps(a, _mm512_set1_ps(s), c); }
inline void fstore(float* p, F v) { _mm512_storeu_ps(p, v); }
