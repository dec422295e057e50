// The AVX-512 build of the attention and RoPE loops: attention_rows.h and attention_body.h over lanes_avx512.h,
// compiled for AVX-512 F/BW/DQ/VL by the pragma below (never by a -march flag). Called only where isa.h's
// best_float() allows it (isa.h: avx512); its bits equal every other build's (paged_attention.cpp).
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

#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")

namespace steady_attn {
namespace avx512 {
namespace {
#include "lanes_avx512.h"
#include "attention_rows.h"
}  // namespace

using avx512_knobs::kWidePasses, avx512_knobs::kScoreAccFloats, avx512_knobs::kValueAccFloats;  // attention.h

// A q8_0 cache's kernels are attention_q8_avx512.cpp's, built with AVX512_VNNI (attention_body.h).
#define STEADY_ATTN_Q8_KERNELS avx512_q8::attend_q8
#include "attention_body.h"

}  // namespace avx512
}  // namespace steady_attn
