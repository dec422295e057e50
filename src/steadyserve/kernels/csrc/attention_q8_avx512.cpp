// The AVX-512 build's kernels for a q8_0 KV cache: attention_rows.h and attention_body.h over lanes_avx512.h, as in
// attention_avx512.cpp, but compiled with AVX512_VNNI as well, for the integer scores' vpdpbusd (score_keys_q8).
// Apart because an AVX-512 CPU may lack VNNI (Intel Skylake-SP): the other formats' kernels must not need it.
// isa.h's best_attention() picks this build for a q8_0 cache only where the CPU has VNNI; its bits equal every other
// build's (paged_attention.cpp).
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

#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")

namespace steady_attn {
namespace avx512_q8 {
namespace {
#include "lanes_avx512.h"
#include "attention_rows.h"
}  // namespace

using avx512_knobs::kWidePasses, avx512_knobs::kScoreAccFloats, avx512_knobs::kValueAccFloats;  // attention.h

#define STEADY_ATTN_Q8_ONLY
#include "attention_body.h"

}  // namespace avx512_q8
}  // namespace steady_attn
