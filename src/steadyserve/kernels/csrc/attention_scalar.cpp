// The baseline (x86-64, SSE2) build of the attention and RoPE loops: attention_rows.h and attention_body.h over
// lanes_scalar.h, compiled with no target pragma: what every x86-64 CPU runs, and the reference the others are held
// to. Called only where isa.h's best_float() allows it; its bits equal every other build's (paged_attention.cpp).
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

namespace steady_attn {
namespace scalar {
namespace {
#include "lanes_scalar.h"
#include "attention_rows.h"
}  // namespace

// No wide passes (attention_body.h): the reference's speed matters less than its build time, which they doubled.
constexpr bool kWidePasses = false;
// Accumulator floats of a pass over a block's K or V rows (attention_body.h's kTokensPerPass): 4 tokens share a
// 16-lane pass at one query head per kv head, so this build runs the shared passes too.
constexpr int kScoreAccFloats = 64;
constexpr int kValueAccFloats = 64;

#include "attention_body.h"

}  // namespace scalar
}  // namespace steady_attn
