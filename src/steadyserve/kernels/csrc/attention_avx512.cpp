// The AVX-512 build of the attention and RoPE loops: attention_body.h compiled for AVX-512 F/BW/DQ/VL by the pragma
// below (never by a -march flag). Called only where isa.h's best_float() allows it (isa.h: avx512); its bits equal
// every other build's (paged_attention.cpp).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "attention.h"
#include "isa.h"
#include "kv_format.h"

#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")

#include "attention_rows.h"

namespace steady_attn {
namespace avx512 {

#include "attention_body.h"

}  // namespace avx512
}  // namespace steady_attn
