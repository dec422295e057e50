// The new tokens' keys and values into their KV cache slots, in the cache's storage format (kv_format.h).
//
// Each stored value (each q8_0 block of 32) is computed from one token's own K or V row alone, by the
// conversions of kv_format.h, so a token's stored K/V depend on nothing else in the step: prefill, decode and
// any batch store the same bytes. Both forward paths store through here (the per-op path through the op
// steadyserve::kv_write, forward.cpp through steady_ops::kv_write_rows), so both store the same bytes.
// A float32 cache is a plain copy. Threads split the (token, head) pairs: O(T x Hkv x D) per layer. The f16
// conversion runs on the float32 build isa.h picks (attention.h's floats_to_halves); everything else is scalar code.
#include "fp_env.h"
#include <ATen/Functions.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "attention.h"
#include "isa.h"
#include "kv_format.h"
#include "ops.h"

namespace {

using namespace steady_kv;

int fmt_of(const at::Tensor& cache) {
  switch (cache.scalar_type()) {
    case at::kFloat: return kF32;
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    case at::kChar: return kQ8;
    default: TORCH_CHECK(false, "kv cache: float32, float16, bfloat16 or int8 (q8_0) only, not ", cache.scalar_type());
  }
}

// n floats as binary16: the f16 cache's write, on a float32 build's lanes (attention.h).
using HalvesFn = decltype(&steady_attn::scalar::floats_to_halves);

// n values (one token's head) into dst[i * stride]: stride 1 for a V row, Bs for a K column. Each value converts
// alone, so converting 64 at a time changes no bit.
void store_row(int fmt, HalvesFn halves, const float* x, uint8_t* dst, int64_t n, int64_t stride) {
  if (fmt == kF32) {
    for (int64_t i = 0; i < n; ++i) std::memcpy(dst + i * stride * 4, x + i, 4);
    return;
  }
  uint16_t h[64];
  for (int64_t i0 = 0; i0 < n; i0 += 64) {
    const int64_t c = n - i0 < 64 ? n - i0 : 64;
    if (fmt == kF16) halves(x + i0, h, c);
    else for (int64_t i = 0; i < c; ++i) h[i] = f32_to_bf16(x[i0 + i]);
    if (stride == 1) std::memcpy(dst + 2 * i0, h, 2 * c);
    else for (int64_t i = 0; i < c; ++i) std::memcpy(dst + (i0 + i) * stride * 2, &h[i], 2);
  }
}

}  // namespace

namespace steady_ops {  // ops.h

void kv_write_rows(at::Tensor& k_cache, at::Tensor& v_cache, const float* k, const float* v, int64_t row_stride,
                   int64_t T, int64_t hkv, int64_t d, const int64_t* blocks, const int64_t* offsets) {
  const int fmt = fmt_of(k_cache);
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.dim() == 4 && v_cache.dim() == 4,
              "kv_write: K and V caches must be contiguous (NB, Hkv, ., .) of one dtype");
  const int64_t bs = k_cache.size(3), hb = head_bytes(fmt, d, bs), nb = k_cache.size(0);
  TORCH_CHECK(fmt != kQ8 || d % kQBlock == 0, "kv_write: q8_0 needs a head dim that is a multiple of 32");
  const HalvesFn halves = steady_attn::build(steady_isa::best_float()).floats_to_halves;
  TORCH_CHECK(k_cache.size(1) == hkv && k_cache.size(2) * k_cache.size(3) * k_cache.element_size() == hb &&
                  v_cache.size(1) == hkv && v_cache.size(2) == bs &&
                  v_cache.size(2) * v_cache.size(3) * v_cache.element_size() == hb && v_cache.size(0) == nb,
              "kv_write: cache shapes do not match the head dim and format");
  uint8_t* kc = static_cast<uint8_t*>(k_cache.data_ptr());
  uint8_t* vc = static_cast<uint8_t*>(v_cache.data_ptr());
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(blocks[t] >= 0 && blocks[t] < nb && offsets[t] >= 0 && offsets[t] < bs, "kv_write: slot out of range");
  }
  // Each (token, head) writes its own slots: threads split them, and nothing read depends on who wrote it. Split,
  // because a float32 K column is D strided stores (one cache line each): serial, a c=16 decode step of a 1.7B
  // model spent 3.4% of its time here while the other thread waited.
  steady_fp::parallel_for(0, T * hkv, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / hkv, h = i % hkv, b = blocks[t], o = offsets[t];
      const float* kx = k + t * row_stride + h * d;
      const float* vx = v + t * row_stride + h * d;
      uint8_t* kh = kc + (b * hkv + h) * hb;  // this block's K region of head h
      uint8_t* vh = vc + (b * hkv + h) * hb;
      if (fmt != kQ8) {
        const int64_t es = fmt == kF32 ? 4 : 2;
        store_row(fmt, halves, kx, kh + o * es, d, bs);     // K (D, Bs): column o
        store_row(fmt, halves, vx, vh + o * d * es, d, 1);  // V (Bs, D): row o
        continue;
      }
      int8_t* kq = reinterpret_cast<int8_t*>(kh);                     // (D/4, Bs, 4) int8, then (D/32, Bs) f16 scales
      int8_t* vq = reinterpret_cast<int8_t*>(vh + o * (d + d / 16));  // this token's D int8, then D/32 scales
      for (int64_t c = 0; c < d / kQBlock; ++c) {
        int8_t kb[kQBlock];
        const uint16_t ks = quantize_q8_0(kx + c * kQBlock, kb);
        for (int64_t a = 0; a < kQBlock; a += 4) std::memcpy(kq + k_q8_at(c * kQBlock + a, o, bs), kb + a, 4);
        std::memcpy(kh + d * bs + 2 * (c * bs + o), &ks, 2);
        const uint16_t vs = quantize_q8_0(vx + c * kQBlock, vq + c * kQBlock);
        std::memcpy(vq + d + 2 * c, &vs, 2);
      }
    }
  });
}

// k, v: (T, Hkv, D) float32 (views of the fused q|k|v rows are fine: rows may be strided, heads not).
void kv_write(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_blocks, const at::Tensor& slot_offsets) {
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.dim() == 3 && v.sizes() == k.sizes(),
              "kv_write: k and v must be (T, Hkv, D) float32");
  TORCH_CHECK(slot_blocks.scalar_type() == at::kLong && slot_offsets.scalar_type() == at::kLong &&
                  slot_blocks.is_contiguous() && slot_offsets.is_contiguous() && slot_blocks.numel() == k.size(0) &&
                  slot_offsets.numel() == k.size(0),
              "kv_write: slot_blocks and slot_offsets must be contiguous (T,) int64");
  const at::Tensor kk = k.contiguous(), vv = v.contiguous();
  steady_ops::kv_write_rows(k_cache, v_cache, kk.data_ptr<float>(), vv.data_ptr<float>(), kk.size(1) * kk.size(2),
                            kk.size(0), kk.size(1), kk.size(2), slot_blocks.data_ptr<int64_t>(),
                            slot_offsets.data_ptr<int64_t>());
}

// The f16 cache's conversion on its own (tests: every build gives every float the same half): x float32, any shape;
// isa: a float32 build index (isa.h; -1: best_float()), refused where the CPU cannot run it.
at::Tensor kv_floats_to_halves(const at::Tensor& x, int64_t isa) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "kv_floats_to_halves: a contiguous float32 tensor");
  const int b = steady_isa::float_build(isa, "kv_floats_to_halves");
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kHalf));
  steady_attn::build(b).floats_to_halves(x.data_ptr<float>(), static_cast<uint16_t*>(out.data_ptr()), x.numel());
  return out;
}

}  // namespace steady_ops
