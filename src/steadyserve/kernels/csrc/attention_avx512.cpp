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

constexpr bool kWidePasses = true;
constexpr int kAccFloats = 256;  // accumulators in 16 of the 32 zmm registers (attention_body.h: kTokensPerPass)

#include "attention_body.h"

}  // namespace avx512
}  // namespace steady_attn
