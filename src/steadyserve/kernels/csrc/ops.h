// Every op of the native kernels as a C++ function: bindings.cpp registers each under its torch name (the same name
// here), and native code that composes them (forward.cpp) calls them directly, so a composition computes exactly
// what the same op calls from Python compute, with no dispatch between. Each checks its arguments' shapes, dtypes
// and indices and refuses by name (TORCH_CHECK: a RuntimeError naming the op and the argument).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <vector>
#include <tuple>

namespace steady_ops {

// ---- the float32 matmul family and the row-wise ops (qlinear.cpp) --------------------------------------------
// y[:, col0 : col0 + N] = x · Wᵀ over a stored-format matrix; a packed format id runs the int8 family.
void qmatmul_(const at::Tensor& x, const at::Tensor& w, int64_t fmt, at::Tensor& y, int64_t col0, int64_t isa);
// The float32 values of the given weight rows (R, K) (embedding lookups, tests).
at::Tensor qdequant(const at::Tensor& w, int64_t fmt, int64_t K, const at::Tensor& rows, int64_t isa);
// (T, D) -> (T, D), one fixed order per row.
at::Tensor qrms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t isa);
// The same into y (T, D) contiguous, which may be x itself.
void qrms_norm_into(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t isa, at::Tensor& y);
// A gated MLP's activation (layer_spec.py's `activation`): act(gate) * up, or gpt-oss's clamped form.
struct GatedAct {
  enum Kind : int64_t { kSilu = 0, kGeluTanh = 1, kSwigluOai = 2 } kind = kSilu;
  float alpha = 0.0f;  // kSwigluOai: the swish's slope
  float limit = 0.0f;  // kSwigluOai: the clamp of gate (above) and up (both sides)
};
// (T, 2I) -> y (T, I) contiguous: the activation of gate (the first I columns) times up (the rest).
void gated_act_into(const at::Tensor& gate_up, int64_t isa, const GatedAct& act, at::Tensor& y);
at::Tensor qsilu_mul(const at::Tensor& gate_up, int64_t isa);
at::Tensor qgelu_tanh_mul(const at::Tensor& gate_up, int64_t isa);
at::Tensor qswiglu_oai_mul(const at::Tensor& gate_up, double alpha, double limit, int64_t isa);
// (T, V) log-softmax per row, out of place (tests) and in place (the sampler).
at::Tensor qlog_softmax(const at::Tensor& x, int64_t isa);
void qlog_softmax_(at::Tensor& x, int64_t isa);
// (T,) int64: each row's first NaN, else its first maximum (NumPy's argmax).
at::Tensor qargmax(const at::Tensor& x, int64_t isa);
int64_t qmm_isa();            // the float32 family's build this process runs (isa.h)
std::vector<int64_t> formats();  // formats.h's records, flat: (ggml id, weights and bytes per block, int8 bits or 0)
int64_t qmm_register_rows();  // rows up to which a matmul costs little more than one (speculation sizes by it)

// ---- rope.cpp, paged_attention.cpp, kv_write.cpp ----------------------------------------------------------------
int64_t attention_isa(bool q8_cache);  // the attention build this process runs for a q8_0 cache or another (isa.h)
// RoPE in place on heads [0, num_heads) of each row.
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads);
// Causal attention over the paged cache; softcap 0 for none; sinks: (H,) attention-sink logits, or none.
void paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_of, const at::Tensor& positions,
                     at::Tensor& out, double scale, int64_t window, double softcap,
                     const std::optional<at::Tensor>& sinks = std::nullopt);
// x = tanh(x / cap) * cap in place (Gemma 2's final-logit soft-capping).
void softcap_(at::Tensor& x, double cap);
// k, v (T, Hkv, D) float32 into their cache slots, in the cache's storage format (kv_format.h).
void kv_write(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_blocks, const at::Tensor& slot_offsets);
// The same from raw rows t of k and v (head h at + t * row_stride + h * d), for forward.cpp.
void kv_write_rows(at::Tensor& k_cache, at::Tensor& v_cache, const float* k, const float* v, int64_t row_stride,
                   int64_t T, int64_t hkv, int64_t d, const int64_t* blocks, const int64_t* offsets);
// The f16 cache's conversions alone (tests: every build gives every value the same bits).
at::Tensor kv_halves_to_floats(const at::Tensor& h, int64_t isa);
at::Tensor kv_floats_to_halves(const at::Tensor& x, int64_t isa);

// ---- moe.cpp ------------------------------------------------------------------------------------------------------
// Router logits (T, E) float32 -> (weights (T, k) float32, experts (T, k) int64) by rank: models/moe.py's route.
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, int64_t top_k, bool norm_topk_prob,
                                              bool topk_softmax = false);

// ---- forward.cpp --------------------------------------------------------------------------------------------------
void register_native_layers(torch::Library& m);  // the NativeLayers class

}  // namespace steady_ops

namespace steady_q8_ops {  // the int8 family (q8linear.cpp)

// y[:, col0 : col0 + N] = x · Wᵀ, x quantized to int8 per block, W packed panels of type packed_fmt (q8.h).
void matmul_packed(const at::Tensor& x, const at::Tensor& w, int64_t packed_fmt, at::Tensor& y, int64_t col0,
                   int64_t isa);
// The same product, then each row's rounding residual as a second int8 row added on the row's panels near its top
// (an output >= its largest - margin; inf: every panel), at most max_panels of them, the largest first (q8.h,
// "Residual rows"): the LM head's order.
void q8matmul_residual_(const at::Tensor& x, const at::Tensor& w, int64_t packed_fmt, at::Tensor& y, int64_t col0,
                        double margin, int64_t max_panels, int64_t isa);
// y rows [starts[g], starts[g + 1]) = those rows of x · ws[g]ᵀ, for every group g in one parallel region; all ws of
// one packed format and shape (N, K). Each row's values are those matmul_packed computes for it.
void matmul_packed_groups(const at::Tensor& x, const std::vector<at::Tensor>& ws, int64_t packed_fmt,
                          const std::vector<int64_t>& starts, at::Tensor& y);
// A GGUF matrix (N, row_bytes) as packed panels (N, packed_row_bytes).
at::Tensor q8pack(const at::Tensor& w, int64_t fmt, int64_t K);
// (xq, dx): the activation quantization alone (tests).
std::tuple<at::Tensor, at::Tensor> q8quantize(const at::Tensor& x, int64_t isa);
int64_t q8_isa();  // the int8 family's build this process runs (isa.h)

}  // namespace steady_q8_ops
