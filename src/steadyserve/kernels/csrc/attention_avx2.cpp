// The AVX2 build of the attention and RoPE loops: attention_rows.h and attention_body.h over lanes_avx2.h, compiled
// for AVX2 + FMA + F16C by the pragma below (never by a -march flag). Called only where isa.h's best_float() allows
// it (isa.h: avx2); its bits equal every other build's (paged_attention.cpp).
#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "attention.h"
#include "half.h"
#include "kv_format.h"

#pragma GCC target("avx2,fma,f16c")

namespace steady_attn {
namespace avx2 {
namespace {
#include "lanes_avx2.h"
#include "attention_rows.h"
}  // namespace

constexpr bool kWidePasses = true;
// Accumulator floats a pass over a block's K rows (scores) or V rows (values) may hold (attention_body.h's
// kTokensPerPass): 8 of the 16 ymm registers.
constexpr int kScoreAccFloats = 64;
constexpr int kValueAccFloats = 64;

#include "attention_body.h"

}  // namespace avx2
}  // namespace steady_attn
