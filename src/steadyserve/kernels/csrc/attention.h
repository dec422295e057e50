// What the per-build attention loops (attention_body.h, compiled once per instruction set) share with the op that
// dispatches to them (paged_attention.cpp): the problem of one call, the kernel types, and each build's entry points.
// The builds differ in vector width only, never in an operation (paged_attention.cpp's reduction order), and the
// op picks one by isa.h's best_float(), like the matmul family: STEADYSERVE_ISA caps it, and tests run each.
#pragma once

#include <cstdint>

namespace steady_attn {

constexpr int kLanes = 16;      // accumulator lanes; part of the numerics, not a tuning knob
constexpr int64_t kTile = 16;  // most tokens per tile: a speed knob only (see the top of paged_attention.cpp)

struct Problem {
  const float* q;        // (T, H, D)
  const uint8_t* k;      // (NB, Hkv, D, Bs) in the storage format (kv_format.h lays out q8_0)
  const uint8_t* v;      // (NB, Hkv, Bs, D) likewise
  int64_t head_bytes;    // bytes of one (block, kv head) region of K or of V
  const int64_t* tables; // (S, NBmax)
  const int64_t* seq_of; // (T,)
  const int64_t* pos;    // (T,)
  float* out;            // (T, H, D)
  int64_t h, hkv, d, bs, nb_max;
  float scale;
  int64_t window;
  float softcap;  // 0: none
  const float* sinks = nullptr;  // (H,) attention-sink logits, one per query head (gpt-oss); null: none
};

// The first key the token at position p attends to: 0, or the start of its sliding window.
inline int64_t first_key(const Problem& P, int64_t p) {
  return P.window > 0 && p - P.window + 1 > 0 ? p - P.window + 1 : 0;
}

using AttendFn = void (*)(const Problem&, int64_t, int64_t, float*, int64_t);
using TileFn = void (*)(const Problem&, int64_t, int64_t, int64_t, float*, int64_t, float*, float*, float*,
                        const uint8_t*);

struct Kernels {
  AttendFn one;  // one token (attend_one); null where a lone token takes the tile path too
  TileFn tile;   // a tile of 2 to kTile tokens of one sequence (attend_tile), or 1 where `one` is null
};

// Each build's entry points (attention_scalar.cpp, attention_avx2.cpp, attention_avx512.cpp).
#define STEADY_ATTN_DECLARE(ns)                                                                                 \
  namespace ns {                                                                                              \
  /* the kernels for a cache format (kv_format.h), query heads per kv head, block size and head dim */         \
  Kernels attend_for_shape(int fmt, int64_t group, int64_t bs, int64_t d);                                    \
  /* x = tanh(x / cap) * cap on n values (Gemma 2's final-logit soft-capping) */                               \
  void softcap_rows(float* x, int64_t n, float cap);                                                          \
  /* RoPE in place on heads [0, num_heads) of rows [t_begin, t_end) (rope.cpp) */                               \
  void rope_rows(float* x, int64_t row_stride, const float* cos, const float* sin, int64_t t_begin, int64_t t_end, \
                 int64_t num_heads, int64_t D);                                                               \
  /* the f16 cache's conversions (kv_write.cpp writes, the kernels read): exact, and round to nearest even */    \
  void halves_to_floats(const uint16_t* h, float* out, int64_t n);                                            \
  void floats_to_halves(const float* x, uint16_t* out, int64_t n);                                            \
  }

STEADY_ATTN_DECLARE(scalar)
STEADY_ATTN_DECLARE(avx2)
STEADY_ATTN_DECLARE(avx512)

// The avx512 build's q8_0-cache kernels, compiled apart with AVX512_VNNI (attention_q8_avx512.cpp; attention_body.h).
namespace avx512_q8 {
Kernels attend_q8(int64_t group, bool wide);
}

// The avx512 build's speed knobs (attention_body.h), one owner for its two units (attention_avx512.cpp and
// attention_q8_avx512.cpp). Accumulator floats a pass over a block's K rows (scores) or V rows (values) may hold
// (kTokensPerPass): 8 and 16 of the 32 zmm registers. With 16 for scores, 4 query heads per kv head (Llama 3.1 8B)
// ran 12% slower than with 8 (AMD EPYC Zen 4).
namespace avx512_knobs {
constexpr bool kWidePasses = true;
constexpr int kScoreAccFloats = 128;
constexpr int kValueAccFloats = 256;
}  // namespace avx512_knobs

// Bytes of one query row of D floats in q8_0 blocks (attention_rows.h's QRow): D int8, D/32 float32 scales and D/32
// int32 offset terms. The op's scratch holds a tile's rows after its scores.
constexpr int64_t q8_row_bytes(int64_t d) { return d + d / 4; }

// One build's entry points: the family's one table, by isa.h's float32 index (0 scalar, 1 avx2, 2 avx512), defined in
// paged_attention.cpp; rope.cpp and kv_write.cpp dispatch through it too.
struct Build {
  decltype(&scalar::attend_for_shape) attend_for_shape;
  decltype(&scalar::softcap_rows) softcap_rows;
  decltype(&scalar::rope_rows) rope_rows;
  decltype(&scalar::halves_to_floats) halves_to_floats;
  decltype(&scalar::floats_to_halves) floats_to_halves;
};
const Build& build(int isa);

}  // namespace steady_attn
