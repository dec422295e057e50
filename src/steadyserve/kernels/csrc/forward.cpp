// The decoder layers of one forward pass in one native call (steadyserve.NativeLayers).
//
// models/transformer.py runs a layer as about twenty op calls from Python: norm, the fused q|k|v
// projection, RoPE, the KV write, attention, the output projection and residual, norm, gate|up,
// silu·mul, down and residual. At one stream a decode step is a few milliseconds, and the Python
// between those calls was a fifth of it. This class holds each layer's weights once and runs the
// same kernels (ops.h), in the same order, on the same tensors, so every value is bitwise the one
// the per-op path computes: there is no new reduction here, only the loop over layers moved to C++.
// The per-op path stays the reference and the fallback (architectures with other layer shapes,
// the host numerics path); tests/test_native_forward.py checks the two bitwise, prefill and decode.
//
// Shapes: x (T, hidden); cos, sin (T, D) by absolute position; k_cache (L, NB, Hkv, D, Bs) and
// v_cache (L, NB, Hkv, Bs, D) (in float32; other storage formats as kv_format.h lays them out); slot_blocks, slot_offsets, seq_of, positions (T,); block_tables
// (S, NBmax). Elementwise adds are exact whatever their order, so in place or not is only memory.
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops.h"

namespace {

// Rows per pass through the MLP. A prefill of 2048 tokens would otherwise hold (2048, 2 I) and (2048, I)
// float32 temporaries at once (37 MiB for SmolLM2), the largest of the step; slices bound them. Every kernel
// here computes a row the same way whatever the number of rows in the call (the matmul family's contract,
// tests/test_qmm.py), so slicing changes memory and never a bit.
constexpr int64_t kMlpRows = 128;

// One weight matrix, stacked by rows from parts that may each have their own stored format.
struct Matrix {
  std::vector<at::Tensor> parts;  // (N_i, row_bytes) uint8, GGML blocks
  std::vector<int64_t> fmts;      // GGML type of each part
  int64_t n = 0;                  // rows in all: the output width
  at::Tensor bias;                // (n,) float32, or undefined
};

struct Layer {
  at::Tensor input_norm, post_norm;  // (hidden,) float32
  Matrix wqkv;                       // ((H + 2 Hkv) D, hidden)
  Matrix wo;                         // (hidden, H D)
  Matrix w_gate_up;                  // (2 I, hidden)
  Matrix w_down;                     // (hidden, I)
};

// x · Wᵀ (+ b), as QMatrix.__call__ and Transformer._linear compute it: parts left to right into
// one output, then the bias added elementwise.
at::Tensor linear(const Matrix& w, const at::Tensor& x) {
  at::Tensor y = at::empty({x.size(0), w.n}, x.options());
  int64_t col = 0;
  for (size_t i = 0; i < w.parts.size(); ++i) {
    steady_ops::qmatmul_into(x, w.parts[i], w.fmts[i], y, col, -1);
    col += w.parts[i].size(0);
  }
  if (w.bias.defined()) y.add_(w.bias);
  return y;
}

class NativeLayers : public torch::CustomClassHolder {
 public:
  NativeLayers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale, int64_t window)
      : h_(num_heads), hkv_(num_kv_heads), d_(head_dim), eps_(eps), scale_(scale), window_(window) {}

  // One layer's weights, in forward order: parts and formats of wqkv, wo, w_gate_up, w_down, with
  // parts_per_matrix giving how many parts each has; biases: four (n,) tensors, empty when absent.
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, std::vector<at::Tensor> parts, std::vector<int64_t> fmts,
                 std::vector<int64_t> parts_per_matrix, std::vector<at::Tensor> biases) {
    TORCH_CHECK(parts.size() == fmts.size() && parts_per_matrix.size() == 4 && biases.size() == 4,
                "NativeLayers.add_layer: 4 matrices, one format per part, 4 biases");
    Layer layer;
    layer.input_norm = input_norm.contiguous();
    layer.post_norm = post_norm.contiguous();
    Matrix* mats[4] = {&layer.wqkv, &layer.wo, &layer.w_gate_up, &layer.w_down};
    size_t next = 0;
    for (int m = 0; m < 4; ++m) {
      for (int64_t i = 0; i < parts_per_matrix[m]; ++i, ++next) {
        TORCH_CHECK(next < parts.size(), "NativeLayers.add_layer: fewer parts than parts_per_matrix says");
        mats[m]->parts.push_back(parts[next]);
        mats[m]->fmts.push_back(fmts[next]);
        mats[m]->n += parts[next].size(0);
      }
      if (biases[m].numel() > 0) {
        TORCH_CHECK(biases[m].numel() == mats[m]->n, "NativeLayers.add_layer: a bias does not match its matrix");
        mats[m]->bias = biases[m].contiguous();
      }
    }
    TORCH_CHECK(next == parts.size(), "NativeLayers.add_layer: more parts than parts_per_matrix says");
    TORCH_CHECK(layer.wqkv.n == (h_ + 2 * hkv_) * d_, "NativeLayers.add_layer: wqkv has ", layer.wqkv.n, " rows");
    layers_.push_back(std::move(layer));
  }

  int64_t num_layers() const { return int64_t(layers_.size()); }

  // Runs every layer over the step's rows; fills the KV cache; returns the hidden states (T, hidden)
  // before the final norm, as Transformer.forward's loop leaves them.
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor k_cache, at::Tensor v_cache,
                     at::Tensor slot_blocks, at::Tensor slot_offsets, at::Tensor block_tables, at::Tensor seq_of,
                     at::Tensor positions) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "NativeLayers.forward: x must be (T, hidden) float32");
    TORCH_CHECK(k_cache.dim() == 5 && v_cache.dim() == 5 && k_cache.size(0) == num_layers() &&
                    k_cache.is_contiguous() && v_cache.is_contiguous(),
                "NativeLayers.forward: caches must be contiguous (L, NB, Hkv, D, Bs) and (L, NB, Hkv, Bs, D)");
    TORCH_CHECK(slot_blocks.scalar_type() == at::kLong && slot_offsets.scalar_type() == at::kLong &&
                    slot_blocks.is_contiguous() && slot_offsets.is_contiguous() &&
                    slot_blocks.numel() == x.size(0) && slot_offsets.numel() == x.size(0),
                "NativeLayers.forward: slot_blocks and slot_offsets must be contiguous (T,) int64");
    const int64_t T = x.size(0), qd = h_ * d_, kvd = hkv_ * d_;
    const int64_t* blocks = slot_blocks.data_ptr<int64_t>();
    const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
    for (int64_t i = 0; i < num_layers(); ++i) {
      const Layer& L = layers_[size_t(i)];
      at::Tensor kc = k_cache.select(0, i), vc = v_cache.select(0, i);
      at::Tensor qkv = linear(L.wqkv, steady_ops::qrms_norm(x, L.input_norm, eps_, -1));  // (T, (H + 2 Hkv) D)
      steady_ops::rope_inplace(qkv, cos, sin, h_ + hkv_);  // q and k heads
      const float* row = qkv.data_ptr<float>();  // k at column qd, v at qd + kvd of each row
      steady_ops::kv_write_rows(kc, vc, row + qd, row + qd + kvd, qkv.stride(0), T, hkv_, d_, blocks, offsets);
      at::Tensor q = qkv.narrow(1, 0, qd).contiguous().view({T, h_, d_});  // (T, H, D)
      at::Tensor attn = at::empty_like(q);
      steady_ops::paged_attention(q, kc, vc, block_tables, seq_of, positions, attn, scale_, window_, 0.0);
      x = x + linear(L.wo, attn.view({T, qd}));
      for (int64_t r0 = 0; r0 < T; r0 += kMlpRows) {  // x is ours now: each slice of rows is updated in place
        at::Tensor rows = x.narrow(0, r0, std::min(kMlpRows, T - r0));
        at::Tensor gate_up = linear(L.w_gate_up, steady_ops::qrms_norm(rows, L.post_norm, eps_, -1));  // (n, 2 I)
        rows.add_(linear(L.w_down, steady_ops::qsilu_mul(gate_up, -1)));
      }
    }
    return x;
  }

 private:
  int64_t h_, hkv_, d_;
  double eps_, scale_;
  int64_t window_;  // sliding window in tokens, 0 for none (paged_attention's mask)
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(steadyserve, m) {
  m.class_<NativeLayers>("NativeLayers")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, int64_t>())
      .def("add_layer", &NativeLayers::add_layer)
      .def("num_layers", &NativeLayers::num_layers)
      .def("forward", &NativeLayers::forward);
}
