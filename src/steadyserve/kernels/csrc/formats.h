// The GGUF weight formats the kernels read: one constexpr traits record per format, from which every other fact
// about a format derives (the float32 family's row bytes in qmm.h, the int8 family's packed layout in q8.h, the
// packer's and the builds' offsets, and which formats every build instantiates: with_format). Adding a format means
// one record here, its decode (qmm_body.h's deq32 and q8_pack.cpp's read_block) and its tests; a format whose
// integers fit the int8 family's planes needs nothing else.
//
// MXFP4 (gpt-oss's experts) is the one format whose scale is no binary16: 17 bytes per 32 weights, an E8M0 exponent e,
// then nibbles as Q4_0's (weight i < 16 low, 16 + i high); weight = kvalue[nibble] * 2^(e - 128) (mxfp4_values,
// e8m0_half below). Its values are integers in [-12, 12] times a power of two, so the int8 family takes them exactly:
// its panels keep the nibbles as Q4_0's planes do (4 bits, `lut`), and each build's unpack turns a nibble into
// u = kvalue + 16 through kMxfp4Stored (a byte shuffle), so the integer sums see Q5_0's values (z = 16,
// |u - z| <= 12) at Q4_0's 4.5 bits a weight; d = 2^(e - 128) is stored as binary16, which holds it exactly
// only for e in [104, 143] (subnormal halves from 2^-24 up, 2^15 the largest power below 65504). A block outside that
// range whose 32 values are all +-0 (gguf-py and llama.cpp write e = 0 for an all-zero block) packs with d = +0: its
// integer sum is 0 whatever d is, so every build's chain adds fma(d, +0, acc) = acc either way. Any other block
// outside it would need a rounded scale: q8pack refuses such a matrix by name (mxfp4_packable, q8_pack.cpp), and
// kernels/quant.py's QWeight.pack keeps it on the float32 family, whose decode is exact for every e.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <utility>

namespace steady_fmt {

// GGML tensor type ids (ggml.h) of the formats with a kernel.
namespace ids {
enum Ggml : int32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30, MXFP4 = 39
};
}  // namespace ids
using namespace ids;

struct Traits {
  int32_t ggml;     // the GGML type id
  int32_t block;    // weights per GGUF block
  int32_t bytes;    // bytes per GGUF block
  // The int8 family's view (q8.h); bits 0: not packable (float formats stay on the float32 family).
  int32_t bits;     // bits of one stored integer: 4, 5, 6 or 8
  int32_t zero;     // the zero point z subtracted from each stored integer
  bool has_min;     // an offset b per block (Q4_1's m, the K-quants' dmin * mn)
  bool sub_scales;  // Q6_K: two int8 sub-scales per block of 32, kept as integers
  bool k_quant;     // a GGUF block is a 256-value super-block (8 blocks of 32) with 6-bit scales
  bool lut = false;  // MXFP4: a stored nibble is an index; the integer it stands for is kMxfp4Stored[nibble]
};

constexpr Traits kFormats[] = {
    {F32, 32, 128, 0, 0, false, false, false},  {F16, 32, 64, 0, 0, false, false, false},
    {BF16, 32, 64, 0, 0, false, false, false},  {Q8_0, 32, 34, 8, 0, false, false, false},
    {Q4_0, 32, 18, 4, 8, false, false, false},  {Q4_1, 32, 20, 4, 0, true, false, false},
    {Q5_0, 32, 22, 5, 16, false, false, false}, {Q4_K, 256, 144, 4, 0, true, false, true},
    {Q5_K, 256, 176, 5, 0, true, false, true},  {Q6_K, 256, 210, 6, 32, false, true, true},
    {MXFP4, 32, 17, 4, 16, false, false, false, true},  // nibbles; u = kMxfp4Stored[nibble], d = 2^(e - 128)
};

// The traits of a GGML type, or nullptr where no kernel reads it.
constexpr const Traits* traits(int32_t ggml) {
  for (const Traits& t : kFormats)
    if (t.ggml == ggml) return &t;
  return nullptr;
}

// Calls fn.template operator()<T>() with T the record of kFormats whose id is `ggml` (a Traits constant, so the callee
// instantiates per format): every kernel's switch over formats is this one, so a record added to kFormats reaches every
// family and build. kInt8Only: only the records the int8 family packs (bits != 0). False where no record matches.
template <bool kInt8Only = false, class Fn>
bool with_format(int32_t ggml, Fn&& fn) {
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    bool found = false;
    (
        [&] {
          constexpr Traits t = kFormats[I];
          if constexpr (!kInt8Only || t.bits != 0) {
            if (!found && t.ggml == ggml) {
              fn.template operator()<t>();
              found = true;
            }
          }
        }(),
        ...);
    return found;
  }(std::make_index_sequence<sizeof(kFormats) / sizeof(kFormats[0])>{});
}

// Bytes of one GGUF row of K weights (K a multiple of the block), -1 for a type without a kernel.
constexpr int64_t row_bytes(int32_t ggml, int64_t K) {
  const Traits* t = traits(ggml);
  return t ? K / t->block * t->bytes : -1;
}

// ---- decoding shared by both families (qmm_body.h's deq32, q8_pack.cpp's read_block) ----------------------------
// The 6-bit scale and min of sub-block s (0..7) of a Q4_K / Q5_K block (gguf-py get_scale_min).
inline void scale_min_k4(const uint8_t* sc, int s, int* scale, int* min) {
  if (s < 4) {
    *scale = sc[s] & 63;
    *min = sc[s + 4] & 63;
  } else {
    *scale = (sc[s + 4] & 0xF) | ((sc[s - 4] >> 6) << 4);
    *min = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
  }
}

// MXFP4 (gguf-py's MXFP4: kvalues, e8m0_to_fp32_half).
// E2M1's values doubled (the scale is halved to match): nibble 8 is a negative zero, read as the integer 0.
constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
// The int8 family's integers for the nibbles: kvalue + 16, in [4, 28] (zero point 16), as the unpack's byte table.
constexpr uint8_t kMxfp4Stored[16] = {16, 17, 18, 19, 20, 22, 24, 28, 16, 15, 14, 13, 12, 10, 8, 4};
// The 32 values' kvalues of the MXFP4 block at b: weight i < 16 from byte 1 + i's low nibble, 16 + i from its high.
inline void mxfp4_values(const uint8_t* b, int8_t (&v)[32]) {
  for (int i = 0; i < 16; ++i) v[i] = kMxfp4Values[b[1 + i] & 15], v[16 + i] = kMxfp4Values[b[1 + i] >> 4];
}
// 2^(e - 128) as a float, exactly (ggml_e8m0_to_fp32_half): subnormal for e < 2, 2^127 for e = 255 (no NaN).
constexpr float e8m0_half(uint8_t e) {
  return std::bit_cast<float>(e < 2 ? uint32_t(0x00200000u) << e : uint32_t(e - 1) << 23);
}
// The exponents whose 2^(e - 128) a binary16 holds exactly: 2^-24 (the smallest subnormal) to 2^15.
constexpr int32_t kMxfp4MinExp = 104, kMxfp4MaxExp = 143;
// 2^(e - 128) as binary16 bits, for e in [kMxfp4MinExp, kMxfp4MaxExp]: subnormal 1 << (e - 104) up to e = 114
// (2^-14, the first normal, has the same bits either way), then the biased exponent e - 128 + 15 over a zero
// mantissa.
constexpr uint16_t e8m0_half_binary16(uint8_t e) {
  return uint16_t(e <= 114 ? 1u << (e - kMxfp4MinExp) : uint32_t(e - 113) << 10);
}
// Whether the int8 family holds the MXFP4 block at b exactly: its scale is a binary16, or its 32 values are all +-0
// (nibbles 0 and 8), which it packs with d = +0 (top of this file).
inline bool mxfp4_packs(const uint8_t* b) {
  if (b[0] >= kMxfp4MinExp && b[0] <= kMxfp4MaxExp) return true;
  uint8_t magnitudes = 0;
  for (int i = 1; i < 17; ++i) magnitudes |= b[i] & 0x77;
  return magnitudes == 0;
}
static_assert(e8m0_half_binary16(104) == 0x0001 && e8m0_half_binary16(113) == 0x0200);
static_assert(e8m0_half_binary16(114) == 0x0400 && e8m0_half_binary16(128) == 0x3c00);
static_assert(e8m0_half_binary16(143) == 0x7800);
static_assert([] {
  for (int i = 0; i < 16; ++i)
    if (kMxfp4Stored[i] != kMxfp4Values[i] + 16) return false;
  return true;
}());

// Whether a packed format's stored integers are table indexes (kMxfp4Stored): the one record with `lut`, which is also
// the one with 4 bits and zero point 16, so the builds' templates (which take bits and zero) can tell it.
constexpr bool lut_of(int32_t bits, int32_t zero) { return bits == 4 && zero == 16; }
// The bits the integer sums' bounds count for a format's values (q8_pack.cpp): a table's values reach 28, 5 bits.
constexpr int32_t value_bits(int32_t bits, int32_t zero) { return lut_of(bits, zero) ? 5 : bits; }
static_assert([] {
  for (const Traits& t : kFormats)
    if (t.bits != 0 && t.lut != lut_of(t.bits, t.zero)) return false;
  return true;
}());

// ---- the int8 family's packed record (q8.h describes it) --------------------------------------------------------
constexpr int32_t kPanelRows = 16;
// Bytes of one block's quant planes for a panel: low nibbles (or bytes) of 16 rows x 32 values, then the high bits.
constexpr int32_t qbytes(int32_t bits) { return bits == 8 ? 512 : 256 + (bits - 4) * 64; }
// Offsets of the scale fields after a record's quant planes, the 16 rows side by side.
constexpr int32_t kScaleD = 0;     // binary16 d[16]
constexpr int32_t kScaleM = 32;    // binary16 m[16] (Q4_1) or dmin[16] (K-quants with a minimum)
constexpr int32_t kScaleSc = 64;   // uint8 sc[8][16] (Q4_K, Q5_K)
constexpr int32_t kScaleMn = 192;  // uint8 mn[8][16] (Q4_K, Q5_K)
constexpr int32_t kScaleSub = 32;  // int8 sc[16][16] (Q6_K: two per block)
constexpr int32_t blocks_per_record(const Traits& t) { return t.k_quant ? 8 : 1; }
constexpr int32_t scale_bytes(const Traits& t) {
  return t.sub_scales ? kScaleSub + 2 * 8 * kPanelRows : t.k_quant ? kScaleMn + 8 * kPanelRows : t.has_min ? 64 : 32;
}
constexpr int32_t record_bytes(const Traits& t) { return blocks_per_record(t) * qbytes(t.bits) + scale_bytes(t); }

static_assert(record_bytes(*traits(Q4_0)) == 256 + 32 && record_bytes(*traits(Q4_1)) == 256 + 64);
static_assert(record_bytes(*traits(Q5_0)) == 320 + 32 && record_bytes(*traits(Q8_0)) == 512 + 32);
static_assert(record_bytes(*traits(Q4_K)) == 8 * 256 + 320 && record_bytes(*traits(Q5_K)) == 8 * 320 + 320);
static_assert(record_bytes(*traits(Q6_K)) == 8 * 384 + 32 + 256);
static_assert(record_bytes(*traits(MXFP4)) == record_bytes(*traits(Q4_0)));  // 18 bytes per 32 weights

}  // namespace steady_fmt
