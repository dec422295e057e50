// Rotary position embedding, in place, with the bits of the PyTorch expression it replaces.
//
// models/layers.py defines RoPE as   x * cos + rotate_half(x) * sin,   where
// rotate_half(x) = cat(-x[half:], x[:half]). PyTorch evaluates that as three rounded
// IEEE operations per element (two products, one sum). This kernel does exactly those
// three, in one pass over memory instead of five tensor ops (neg, cat, mul, mul, add):
//   out[d]        = x[d] * c[d]               + (-x[d + half]) * s[d]
//   out[d + half] = x[d + half] * c[d + half] + x[d] * s[d + half]
// Negation is exact and rounding to nearest is symmetric, so -(a * b) == (-a) * b.
// -ffp-contract=off (build.py) keeps the compiler from fusing a product into the sum,
// so the vector width of the build isa.h picks (attention_body.h) changes speed, never bits. tests/
// test_attention_kernel.py checks it against the PyTorch expression, bitwise.

#include "fp_env.h"
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>

#include "attention.h"
#include "isa.h"
#include "ops.h"

namespace steady_ops {  // ops.h; registered in bindings.cpp

void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rope_: float32 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rope_: x must be (T, width) with unit column stride");
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && sin.is_contiguous() && sin.sizes() == cos.sizes(),
              "rope_: cos and sin must be contiguous (T, D)");
  const int64_t T = x.size(0), D = cos.size(1);
  TORCH_CHECK(cos.size(0) == T && D % 2 == 0 && num_heads >= 0 && num_heads * D <= x.size(1),
              "rope_: shapes do not match");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t row_stride = x.stride(0);
  const auto rope_rows = steady_attn::build(steady_isa::best_float()).rope_rows;
  steady_fp::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    rope_rows(xp, row_stride, cp, sp, begin, end, num_heads, D);
  });
}

}  // namespace steady_ops
