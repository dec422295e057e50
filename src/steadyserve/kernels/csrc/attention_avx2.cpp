// The AVX2 build of the attention and RoPE loops: attention_body.h compiled for AVX2 + FMA + F16C by the pragma below
// (never by a -march flag). Called only where isa.h's best_float() allows it (isa.h: avx2); its bits equal every
// other build's (paged_attention.cpp).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "attention.h"
#include "isa.h"
#include "kv_format.h"

#pragma GCC target("avx2,fma,f16c")

#include "attention_rows.h"

namespace steady_attn {
namespace avx2 {

#include "attention_body.h"

}  // namespace avx2
}  // namespace steady_attn
