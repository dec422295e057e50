// The int8-activation matmul family: y = x · Wᵀ with x quantized to int8 per block of 32 and W
// repacked once at load from its GGUF block format into 16-row panels (q8_pack.cpp).
//
// THE REDUCTION ORDER (the numerics of every build: scalar, AVX2, AVX-512 VNNI, AMX):
//   Activations. Row m of x is cut into blocks c of 32 values. For each block, by IEEE operations on
//   that block alone (so a row's quantization depends on nothing else in the batch):
//     amax = max |x_k| (exact in any order); dx = amax / 127; s = 127 / amax (0 when amax is 0);
//     q_k = round-half-even(x_k * s), an int8 in [-127, 127]; sx = sum q_k (an int);
//     sxd = dx * float(sx).
//     A block with a non-finite value gets dx = NaN, so the outputs it touches are NaN.
//   Weights. Each stored weight is an integer u (0..15, 0..31, 0..63, or a signed byte for Q8_0) with,
//   per row and block of 32, a float multiplier a and (formats with a minimum) an offset b, both
//   computed from the GGUF fields with gguf-py's own IEEE operations (a = d, or d * sc for K-quants;
//   b = m, or -(dmin * mn)). Q6_K keeps its two int8 sub-scales sc_lo, sc_hi as integers.
//   For one output y[m, n], blocks c in ascending order, acc starting at +0:
//     I_c = sum_k (u_k - z) * q_k, exact in int32 whatever order or instruction computes it
//           (z: 8 for Q4_0, 16 for Q5_0 and MXFP4, 0 otherwise; for Q6_K, sc_lo * sum over the first 16 of
//           (u - 32) q + sc_hi * sum over the last 16). |I_c| < 2^25: no overflow (bounds in q8_pack.cpp).
//     t   = float(I_c) * dx_c                   (one rounding; float() rounds to nearest even)
//     acc = fma(a_c, t, acc)                    (one rounding)
//     acc = fma(b_c, sxd_c, acc)                (formats with a minimum only)
//   y[m, n] = acc. Each output is one chain of float operations in c; nothing in it depends on M,
//   on how threads split N (by 16-row panels), or on the ISA: a vector build holds 16 outputs (one
//   panel) in the lanes of its registers and runs each lane's chain exactly as the scalar build runs
//   one output. Only the integer sums differ in how they are formed (AMX tdpbsud/tdpbssd, VNNI vpdpbusd,
//   AVX2 maddubs/madd with the sign trick for Q8_0, plain loops), and integer sums are exact. (The vector builds
//   form Q6_K's float(I_c) as fma(sc_lo, lo, sc_hi * hi) of its two sub-scaled halves: each product is below 2^24,
//   so exact, and the fma rounds the exact I_c once: the same float.)
//   Residual rows (the LM head, q8linear.cpp's q8matmul_residual_). Each row x_m is quantized as above into q, dx,
//   and y_x = the chain above is every output. Then r_k = x_k - float(q_k) * dx_c (one multiply, one subtract: two
//   roundings), row m's rounding residual, is quantized the same way as a row of its own, and on every panel of
//   16 outputs that holds one with y_x[m, n] >= max_n' y_x[m, n'] - margin (the max exact; NaN outputs skipped),
//   at most max_panels of them per row (those with the largest outputs, a tie to the lower panel),
//   y[m, n] = y_x[m, n] + y_r[m, n] (one rounding), y_r being r's chain. The model sets the margin so that the
//   tokens that carry the probability are corrected (models/transformer.py, head_margin): each of the rest holds
//   below e^-10 of it, so their one-row logits barely move the normalizer. The corrected logits see their
//   activations to about 15 bits where one int8 row holds about 8: a small model's logits carry most of the int8
//   path's error, and a logit's error is a logprob's. Everything in it is row-wise, so it keeps every property
//   above.
//
// F16, BF16 and F32 weights are not packed: they stay on the float32 path (qmm.h).
#pragma once

#include <cstdint>

#include "formats.h"

namespace steady_q8 {

constexpr int64_t kPanel = 16;     // weight rows per panel: the lanes of one AVX-512 register
constexpr int64_t kBlock = 32;     // values per block, activations and weights alike
constexpr int32_t kPacked = 256;   // a packed format's id is kPacked + the GGML type it came from

// How a GGML type packs: bits per stored integer, its zero point, whether it has an offset b.
struct PackedLayout {
  int32_t bits;     // 4, 5, 6 or 8
  int32_t zero;     // z above
  bool has_min;     // b present
  bool sub_scales;  // Q6_K: two int8 sub-scales per block
  bool k_quant;     // a record covers a 256-value super-block (8 blocks) and keeps its 6-bit scales as bytes
  bool lut;         // MXFP4: the 4-bit planes hold indexes; the integer is formats.h's kMxfp4Stored[index]
  int32_t qbytes;   // bytes of one block's stored integers (the quant planes below)
  int32_t record;   // bytes per (panel, record) = blocks per record * qbytes + the scale fields
};

// A panel's record covers 1 block (Q4_0, Q4_1, Q5_0, Q8_0) or the 8 blocks of a super-block (K-quants).
// First, each block's quant planes, qbytes each (r: the panel's row 0..15, i: 0..3, j: 0..3):
//   [0, 256)   low nibbles: byte 64 j + 4 r + i holds u[r][4 j + i] & 15 (low) and u[r][16 + 4 j + i] & 15
//              (high). 8-bit formats instead store [0, 512): byte 64 j + 4 r + i = u[r][4 j + i], j = 0..7.
//   5-bit:     [256, 320): byte 4 r + i, bit j = bit 4 of u[r][4 j + i], j = 0..7.
//   6-bit:     [256, 384): byte 64 h + 4 r + i, bits 2 jj, 2 jj + 1 = bits 4, 5 of u[r][4 (4 h + jj) + i].
// So one 64-byte load (after unpacking) holds, for 4 consecutive k of the block, all 16 rows' values in
// the order VNNI's vpdpbusd multiplies against a broadcast 4 bytes of x.
// Then the GGUF's own scale fields, the 16 rows side by side (binary16 as stored, 6-bit scales as bytes),
// from which a and b are computed at each use with gguf-py's operations:
//   Q4_0, Q5_0, Q8_0: d[16] (a = d).          Q4_1: d[16], m[16] (a = d, b = m).
//   MXFP4: d[16] = 2^(e - 128) as binary16, exactly (formats.h says which exponents pack; a = d).
//   Q4_K, Q5_K: d[16], dmin[16], sc[8][16], mn[8][16] uint8 (block s: a = d * sc[s], b = -(dmin * mn[s])).
//   Q6_K: d[16], sc[16][16] int8 (a = d; block s: sc_lo = sc[2 s], sc_hi = sc[2 s + 1]).
// A packed matrix is as large as the GGUF's (K-quants: 2-3% more, the 6-bit scales as bytes), except MXFP4's: 18
// bytes per 17 (Q4_0's record, its nibbles kept as indexes into formats.h's kMxfp4Stored, which each build's
// unpack applies with a byte shuffle; a binary16 d for the exponent byte).
bool packed_layout(int32_t ggml_type, PackedLayout* out);

// How far ahead of its reads a thread asks for its weight stream (q8_unpack.h's prefetch_ahead), in bytes; 0: no
// hint of that kind. A hint never changes a value: the distances are chosen per CPU vendor (q8linear.cpp).
struct Prefetch {
  int32_t l1;  // _MM_HINT_T0, into L1
  int32_t l2;  // _MM_HINT_T1, into L2
};

// The operands of one packed matmul, for the panels [p_begin, p_end) of one thread.
struct Q8Args {
  int32_t fmt;            // the GGML type that was packed
  PackedLayout lay;
  const int8_t* xq;       // (M, K) quantized activations
  const float* dx;        // (M, K / 32) block scales
  const float* sxd;       // (M, K / 32) dx * float(sum of the block's q)
  const int32_t* sx;      // (M, K / 32) sum of the block's q
  const int32_t* zx16;    // (M, K / 16) -32 x the sum of each half block's q: Q6_K's zero-point terms, which
                          // start its two integer chains (q8_body.h), precomputed so a tile reads them as they are
  int64_t M, K;
  const uint8_t* w;       // packed panels: panel p's record t at w + (p * records + t) * record
  float* y;               // (M, >= 16 p_end), row stride y_stride floats
  int64_t y_stride;
  int64_t p_begin, p_end;
  Prefetch ahead;         // this CPU's prefetch distances
};

// Whether every block of an MXFP4 matrix packs exactly (formats.h's mxfp4_packs); else false, with the first block
// that does not (row, block). pack() takes an MXFP4 matrix only where this holds (q8pack checks it).
bool mxfp4_packable(const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, int64_t* bad_row, int64_t* bad_block);
// Repacks N rows (N a multiple of 16) of a GGUF matrix into panels (q8_pack.cpp).
void pack(int32_t ggml_type, const uint8_t* w, int64_t row_bytes, int64_t N, int64_t K, uint8_t* out);
// Quantizes rows [m0, m1) of x (row stride x_stride) as the order above says: q8_quantize.h, compiled in every
// build over its own lanes (the same IEEE operations per value, so the same bits).
#define STEADY_Q8_DECLARE(ns)                                                                                 \
  namespace ns {                                                                                              \
  void matmul(const Q8Args& a);                                                                               \
  void quantize_rows(const float* x, int64_t x_stride, int64_t K, int64_t m0, int64_t m1, int8_t* xq, float* dx, \
                     float* sxd, int32_t* sx, int32_t* zx16);                                                 \
  /* each panel's largest non-NaN output of rows [0, M), panels [p0, p1): q8_tops.h */                        \
  void panel_tops(const float* y, int64_t y_stride, int64_t M, int64_t p0, int64_t p1, float* tops,             \
                  int64_t tops_stride);                                                                       \
  }

STEADY_Q8_DECLARE(scalar)
STEADY_Q8_DECLARE(avx2)
STEADY_Q8_DECLARE(avx512)  // AVX-512 VNNI
// AMX tiles for each 16 rows, the VNNI build for the rest; its activations are the VNNI build's quantize_rows.
namespace amx {
void matmul(const Q8Args& a);
}

}  // namespace steady_q8
