// The GGUF weight formats the kernels read: one constexpr traits record per format, from which every other fact
// about a format derives (the float32 family's row bytes in qmm.h, the int8 family's packed layout in q8.h, the
// packer's and the builds' offsets, and which formats every build instantiates: with_format). Adding a format means
// one record here, its decode (qmm_body.h's deq32 and q8_pack.cpp's read_block) and its tests; a format whose
// integers fit the int8 family's planes needs nothing else.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

namespace steady_fmt {

// GGML tensor type ids (ggml.h) of the formats with a kernel.
namespace ids {
enum Ggml : int32_t { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30 };
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
};

constexpr Traits kFormats[] = {
    {F32, 32, 128, 0, 0, false, false, false},  {F16, 32, 64, 0, 0, false, false, false},
    {BF16, 32, 64, 0, 0, false, false, false},  {Q8_0, 32, 34, 8, 0, false, false, false},
    {Q4_0, 32, 18, 4, 8, false, false, false},  {Q4_1, 32, 20, 4, 0, true, false, false},
    {Q5_0, 32, 22, 5, 16, false, false, false}, {Q4_K, 256, 144, 4, 0, true, false, true},
    {Q5_K, 256, 176, 5, 0, true, false, true},  {Q6_K, 256, 210, 6, 32, false, true, true},
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

}  // namespace steady_fmt
