// The kernels as C++ functions, for native code that composes them (forward.cpp). Each is the
// function behind the torch op of the same name (qlinear.cpp, rope.cpp, paged_attention.cpp), so a
// composition computes exactly what the same op calls from Python compute, with no dispatch between.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace steady_ops {

// y[:, col0 : col0 + N] = x · Wᵀ over a stored-format matrix (steadyserve::qmatmul_).
void qmatmul_into(const at::Tensor& x, const at::Tensor& w, int64_t fmt, at::Tensor& y, int64_t col0, int64_t isa);
// (T, D) -> (T, D), one fixed order per row (steadyserve::qrms_norm).
at::Tensor qrms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t isa);
// The same into y (T, D) contiguous, which may be x itself.
void qrms_norm_into(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t isa, at::Tensor& y);
// (T, 2I) -> y (T, I) contiguous: gelu_tanh(gate) * up when `gelu` (steadyserve::qgelu_tanh_mul), else
// silu(gate) * up (steadyserve::qsilu_mul).
void gated_act_into(const at::Tensor& gate_up, int64_t isa, bool gelu, at::Tensor& y);
// RoPE in place on heads [0, num_heads) of each row (steadyserve::rope_).
void rope_inplace(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads);
// Causal attention over the paged cache (steadyserve::paged_attention); softcap 0 for none.
void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_of, const at::Tensor& positions,
                     at::Tensor& out, double scale, int64_t window, double softcap);
// Rows t of k and v (float32, head h at + t * row_stride + h * d) into their cache slots, in the cache's
// storage format, chosen by its dtype (kv_format.h; steadyserve::kv_write).
void kv_write_rows(at::Tensor& k_cache, at::Tensor& v_cache, const float* k, const float* v, int64_t row_stride,
                   int64_t T, int64_t hkv, int64_t d, const int64_t* blocks, const int64_t* offsets);

}  // namespace steady_ops

namespace steady_q8_ops {  // q8linear.cpp

// y[:, col0 : col0 + N] = x · Wᵀ, x quantized to int8 per block, W packed panels of type packed_fmt (q8.h).
void matmul_packed(const at::Tensor& x, const at::Tensor& w, int64_t packed_fmt, at::Tensor& y, int64_t col0,
                   int64_t isa);

}  // namespace steady_q8_ops
