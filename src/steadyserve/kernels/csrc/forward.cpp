// The decoder layers of one forward pass in one native call (steadyserve.NativeLayers).
//
// What a layer computes is models/layer_spec.py's LayerSpec, read here as the constructor's and
// add_layer's arguments: norms before and/or after attention and MLP, a q/k RMSNorm per head or over
// all heads, SiLU, GELU-tanh or gpt-oss's clamped SwiGLU, the score scale and soft-cap, a residual multiplier,
// and per layer its sliding window, RoPE table (or none) and attention sinks (or none). Each is a kernel the per-op path (Transformer._qkv,
// _out_mlp) calls through its torch op, or one exact elementwise operation. A sparse layer (add_experts)
// runs moe.h's block, models/moe.py's router and experts op for op, in place of the gated MLP.
//
// models/transformer.py runs a layer as about twenty op calls from Python: norm, the fused q|k|v
// projection, RoPE, the KV write, attention, the output projection and residual, norm, gate|up,
// silu·mul, down and residual. At one stream a decode step is a few milliseconds, and the Python
// between those calls was a fifth of it. This class holds each layer's weights once and runs the
// same kernels (ops.h), in the same order, on the same tensors, so every value is bitwise the one
// the per-op path computes: there is no new reduction here, only the loop over layers moved to C++.
// The per-op path stays the reference and the fallback (the host numerics path, Python attention, a
// spec this class cannot run: layer_spec.native_supports); tests/test_native_forward.py checks the two
// bitwise, prefill and decode, on every architecture.
//
// Shapes: x (T, hidden); cos, sin: lists of (T, D) tables by absolute position, one per RoPE kind;
// k_cache (Lg, NB, Hkv, D, Bs) and v_cache (Lg, NB, Hkv, Bs, D), Lg slots that layers share by group (in float32;
// other storage formats as kv_format.h lays them out); slot_offsets, seq_of, positions (T,); slot_blocks (G, T)
// and block_tables (G, S, NBmax), one per group of layers.
// Elementwise adds are exact whatever their order, so in place or not is only memory.
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "fp_env.h"
#include "matrix.h"
#include "moe.h"
#include "ops.h"

namespace {

using steady_layers::Experts;
using steady_layers::Matrix;
using steady_layers::linear_into;

// Rows per pass through the MLP. A prefill of 2048 tokens would otherwise hold (2048, 2 I) and (2048, I)
// float32 temporaries at once (37 MiB for SmolLM2), the largest of the step; slices bound them. Every kernel
// here computes a row the same way whatever the number of rows in the call (the matmul family's contract,
// tests/test_qmm.py), so slicing changes memory and never a bit.
constexpr int64_t kMlpRows = 128;

// Norms are undefined where the spec has none (OLMo 2's pre-norms, Llama's q/k and output norms).
struct Layer {
  at::Tensor input_norm, post_norm;        // (hidden,) float32: before attention, before the MLP
  at::Tensor q_norm, k_norm;               // (D,) per head, or (H D,) / (Hkv D,) over all heads
  at::Tensor attn_out_norm, mlp_out_norm;  // (hidden,): on each block's output, before its residual add
  Matrix wqkv;                             // ((H + 2 Hkv) D, hidden)
  Matrix wo;                               // (hidden, H D)
  Matrix w_gate_up;                        // (2 I, hidden)
  Matrix w_down;                           // (hidden, I)
  std::unique_ptr<Experts> experts;        // a sparse layer's router and experts (moe.h), in place of the MLP
  int64_t window = 0;                      // sliding window in tokens, 0 for none (paged_attention's mask)
  at::Tensor sinks;                        // (H,) float32 attention-sink logits (gpt-oss), or undefined
  int64_t rope = 0;                        // index of its cos/sin table in forward's lists; -1: no RoPE
};

// The first `rows` rows of a flat buffer as a contiguous (rows, width) matrix.
at::Tensor rows_of(const at::Tensor& flat, int64_t rows, int64_t width) {
  return flat.narrow(0, 0, rows * width).view({rows, width});
}

at::Tensor defined_or_none(const at::Tensor& t) { return t.numel() > 0 ? t.contiguous() : at::Tensor(); }

class NativeLayers : public torch::CustomClassHolder {
 public:
  // The model-wide part of the LayerSpec. qk_norm_heads: 0 for no q/k norm, 1 for one norm row per head
  // (Qwen3, Gemma 3), 2 for one row over all heads (OLMo 2). act: the gated MLP's activation (ops.h's GatedAct
  // kinds: 0 SiLU, 1 GELU-tanh, 2 gpt-oss's clamped SwiGLU with act_alpha and act_limit).
  NativeLayers(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale, double softcap,
               bool pre_norm, int64_t qk_norm_heads, int64_t act, double act_alpha, double act_limit,
               double residual_scale)
      : h_(num_heads), hkv_(num_kv_heads), d_(head_dim), eps_(eps), scale_(scale), softcap_(softcap),
        pre_norm_(pre_norm), qk_norm_heads_(qk_norm_heads), residual_scale_(residual_scale) {
    TORCH_CHECK(qk_norm_heads >= 0 && qk_norm_heads <= 2, "NativeLayers: qk_norm_heads is 0, 1 or 2");
    TORCH_CHECK(act >= 0 && act <= 2, "NativeLayers: act is 0 (SiLU), 1 (GELU-tanh) or 2 (clamped SwiGLU)");
    act_ = {steady_ops::GatedAct::Kind(act), float(act_alpha), float(act_limit)};
  }

  // One layer's weights, in forward order. norms: input, post (pre-MLP), q, k, attention-output and
  // MLP-output norms, each empty when the spec has none; parts and formats of wqkv, wo, w_gate_up, w_down,
  // with parts_per_matrix giving how many parts each has; biases: four (n,) tensors, empty when absent;
  // window and rope: the layer's sliding window (0: none) and cos/sin table index (-1: no RoPE); sinks: (H,)
  // attention-sink logits, empty for none.
  void add_layer(std::vector<at::Tensor> norms, std::vector<at::Tensor> parts, std::vector<int64_t> fmts,
                 std::vector<int64_t> parts_per_matrix, std::vector<at::Tensor> biases, int64_t window,
                 int64_t rope, at::Tensor sinks) {
    TORCH_CHECK(norms.size() == 6 && parts.size() == fmts.size() && parts_per_matrix.size() == 4 && biases.size() == 4,
                "NativeLayers.add_layer: 6 norms, 4 matrices, one format per part, 4 biases");
    Layer layer;
    layer.input_norm = defined_or_none(norms[0]);
    layer.post_norm = defined_or_none(norms[1]);
    layer.q_norm = defined_or_none(norms[2]);
    layer.k_norm = defined_or_none(norms[3]);
    layer.attn_out_norm = defined_or_none(norms[4]);
    layer.mlp_out_norm = defined_or_none(norms[5]);
    TORCH_CHECK(layer.input_norm.defined() == pre_norm_ && layer.post_norm.defined() == pre_norm_,
                "NativeLayers.add_layer: the pre-norms must be given exactly when pre_norm is set");
    TORCH_CHECK(layer.q_norm.defined() == (qk_norm_heads_ != 0) && layer.k_norm.defined() == (qk_norm_heads_ != 0),
                "NativeLayers.add_layer: the q/k norms must be given exactly when qk_norm_heads is not 0");
    TORCH_CHECK(layer.attn_out_norm.defined() == layer.mlp_out_norm.defined(),
                "NativeLayers.add_layer: both output norms or neither");
    layer.window = window;
    layer.rope = rope;
    layer.sinks = defined_or_none(sinks);
    TORCH_CHECK(!layer.sinks.defined() || layer.sinks.numel() == h_, "NativeLayers.add_layer: one sink per query head");
    Matrix* mats[4] = {&layer.wqkv, &layer.wo, &layer.w_gate_up, &layer.w_down};
    size_t next = 0;
    for (int m = 0; m < 4; ++m) {
      next = steady_layers::take_parts(*mats[m], parts, fmts, next, parts_per_matrix[m], "NativeLayers.add_layer");
      if (biases[m].numel() > 0) {
        TORCH_CHECK(biases[m].numel() == mats[m]->n, "NativeLayers.add_layer: a bias does not match its matrix");
        mats[m]->bias = biases[m].contiguous();
      }
    }
    TORCH_CHECK(next == parts.size(), "NativeLayers.add_layer: more parts than parts_per_matrix says");
    TORCH_CHECK(layer.wqkv.n == (h_ + 2 * hkv_) * d_, "NativeLayers.add_layer: wqkv has ", layer.wqkv.n, " rows");
    max_gate_up_ = std::max(max_gate_up_, layer.w_gate_up.n);
    layers_.push_back(std::move(layer));
  }

  // The last added layer becomes sparse (models/moe.py): its MLP matrices must have been given no parts. parts and
  // fmts: the router's, then each expert's gate|up, then each expert's down, parts_per_matrix giving how many
  // each of those 1 + 2 E matrices has; biases: none, or one (n,) tensor per matrix in the same order (empty for
  // none). topk_softmax: gpt-oss's routing (the k largest logits, then their softmax).
  void add_experts(int64_t top_k, bool norm_topk_prob, bool topk_softmax, int64_t width, std::vector<at::Tensor> parts,
                   std::vector<int64_t> fmts, std::vector<int64_t> parts_per_matrix, std::vector<at::Tensor> biases) {
    TORCH_CHECK(!layers_.empty(), "NativeLayers.add_experts: no layer to add them to");
    Layer& layer = layers_.back();
    TORCH_CHECK(layer.w_gate_up.n == 0 && layer.w_down.n == 0 && !layer.experts,
                "NativeLayers.add_experts: the layer already has an MLP");
    TORCH_CHECK(parts_per_matrix.size() % 2 == 1 && parts_per_matrix.size() >= 3 && parts.size() == fmts.size(),
                "NativeLayers.add_experts: a router and E >= 1 gate|up and down matrices");
    const size_t E = parts_per_matrix.size() / 2;
    auto ex = std::make_unique<Experts>();
    ex->top_k = top_k;
    ex->norm_topk = norm_topk_prob;
    ex->topk_softmax = topk_softmax;
    ex->width = width;
    ex->gate_up.resize(E);
    ex->down.resize(E);
    const char* who = "NativeLayers.add_experts";
    size_t next = steady_layers::take_parts(ex->router, parts, fmts, 0, parts_per_matrix[0], who);
    for (size_t e = 0; e < E; ++e) next = steady_layers::take_parts(ex->gate_up[e], parts, fmts, next, parts_per_matrix[1 + e], who);
    for (size_t e = 0; e < E; ++e) next = steady_layers::take_parts(ex->down[e], parts, fmts, next, parts_per_matrix[1 + E + e], who);
    TORCH_CHECK(next == parts.size(), who, ": more parts than parts_per_matrix says");
    TORCH_CHECK(biases.empty() || biases.size() == 1 + 2 * E, who, ": no biases, or one per matrix");
    for (size_t m = 0; m < biases.size(); ++m) {
      Matrix& mat = m == 0 ? ex->router : m <= E ? ex->gate_up[m - 1] : ex->down[m - 1 - E];
      if (biases[m].numel() == 0) continue;
      TORCH_CHECK(biases[m].numel() == mat.n, who, ": bias ", m, " does not match its matrix");
      mat.bias = biases[m].contiguous();
    }
    TORCH_CHECK(ex->router.n == int64_t(E) && top_k >= 1 && top_k <= int64_t(E), who, ": the router has ",
                ex->router.n, " rows for ", E, " experts, top_k ", top_k);
    for (size_t e = 0; e < E; ++e) {
      TORCH_CHECK(ex->gate_up[e].n == 2 * width && ex->down[e].n == ex->down[0].n, who, ": expert ", e,
                  " has gate|up of ", ex->gate_up[e].n, " rows for width ", width);
    }
    layer.experts = std::move(ex);
  }

  int64_t num_layers() const { return int64_t(layers_.size()); }

  // Layer i's sparse block alone on normed rows x (T, hidden) -> (T, hidden), as forward runs it (the tests set it
  // against models/moe.py's moe_block).
  at::Tensor sparse_block(int64_t i, at::Tensor x) const {
    const steady_fp::Scope fp;
    TORCH_CHECK(i >= 0 && i < num_layers() && layers_[size_t(i)].experts, "NativeLayers.sparse_block: layer ", i,
                " is not sparse");
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "NativeLayers.sparse_block: x must be (T, hidden) float32");
    x = x.contiguous();
    at::Tensor out = at::empty({x.size(0), layers_[size_t(i)].experts->down[0].n}, x.options());
    steady_layers::sparse_block_into(*layers_[size_t(i)].experts, x, act_, out);
    return out;
  }

  // Runs every layer over the step's rows; fills the KV cache; returns the hidden states (T, hidden)
  // before the final norm, as Transformer.forward's loop leaves them. cos[i], sin[i]: table i's rows.
  // kv_slot[i], kv_group[i]: layer i's slot in the caches' first dimension and its group's index in block_tables
  // and slot_blocks (engine/kv_layout.py: a hybrid model's windowed layers keep their own block tables).
  at::Tensor forward(at::Tensor x, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin, at::Tensor k_cache,
                     at::Tensor v_cache, at::Tensor slot_blocks, at::Tensor slot_offsets, at::Tensor block_tables,
                     at::Tensor seq_of, at::Tensor positions, std::vector<int64_t> kv_slot,
                     std::vector<int64_t> kv_group) {
    const steady_fp::Scope fp;  // a method of a class, not an op: bindings.cpp's wrapper does not reach it
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2, "NativeLayers.forward: x must be (T, hidden) float32");
    TORCH_CHECK(cos.size() == sin.size(), "NativeLayers.forward: one sin table per cos table");
    TORCH_CHECK(k_cache.dim() == 5 && v_cache.dim() == 5 && k_cache.is_contiguous() && v_cache.is_contiguous(),
                "NativeLayers.forward: caches must be contiguous (Lg, NB, Hkv, D, Bs) and (Lg, NB, Hkv, Bs, D)");
    TORCH_CHECK(block_tables.dim() == 3 && slot_blocks.dim() == 2 && slot_blocks.size(0) == block_tables.size(0),
                "NativeLayers.forward: block_tables must be (G, S, NBmax) and slot_blocks (G, T)");
    TORCH_CHECK(int64_t(kv_slot.size()) == num_layers() && int64_t(kv_group.size()) == num_layers(),
                "NativeLayers.forward: one kv slot and one kv group per layer");
    for (int64_t i = 0; i < num_layers(); ++i)
      TORCH_CHECK(kv_slot[size_t(i)] >= 0 && kv_slot[size_t(i)] < k_cache.size(0) && kv_group[size_t(i)] >= 0 &&
                      kv_group[size_t(i)] < block_tables.size(0),
                  "NativeLayers.forward: layer ", i, "'s kv slot or group is out of range");
    TORCH_CHECK(slot_blocks.scalar_type() == at::kLong && slot_offsets.scalar_type() == at::kLong &&
                    slot_blocks.is_contiguous() && slot_offsets.is_contiguous() &&
                    slot_blocks.size(1) == x.size(0) && slot_offsets.numel() == x.size(0),
                "NativeLayers.forward: slot_blocks (G, T) and slot_offsets (T,) must be contiguous int64");
    const int64_t T = x.size(0), qd = h_ * d_, kvd = hkv_ * d_, R = std::min(kMlpRows, T);
    const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
    // What the layers write, allocated once per call and reused by every layer, where each layer allocated about
    // ten tensors. With q8linear.cpp's workspace, a 1.7B-shaped model's one-row decode step spent 0.6 ms instead
    // of 1.2 in malloc and ATen's tensor code (AMD EPYC, perf, two runs each).
    x = x.clone(at::MemoryFormat::Contiguous);  // (T, hidden): the residual stream, updated in place
    at::Tensor normed = at::empty_like(x);  // (T, hidden): a norm's output, the input of the next matrix
    at::Tensor qkv = at::empty({T, (h_ + 2 * hkv_) * d_}, x.options());
    at::Tensor attn = at::empty({T, h_, d_}, x.options());
    at::Tensor out = at::empty_like(x);  // (T, hidden): wo's output, then each MLP slice's down projection
    at::Tensor gate_up = at::empty({R * max_gate_up_}, x.options());   // (R, 2 I) of each slice
    at::Tensor act = at::empty({R * max_gate_up_ / 2}, x.options());  // (R, I)
    std::vector<at::Tensor> group_tables;  // (S, NBmax) of each group: one view each per call, not per layer
    for (int64_t g = 0; g < block_tables.size(0); ++g) group_tables.push_back(block_tables.select(0, g));
    for (int64_t i = 0; i < num_layers(); ++i) {
      const Layer& L = layers_[size_t(i)];
      TORCH_CHECK(L.rope < int64_t(cos.size()), "NativeLayers.forward: layer ", i, " reads RoPE table ", L.rope);
      const int64_t g = kv_group[size_t(i)];
      at::Tensor kc = k_cache.select(0, kv_slot[size_t(i)]), vc = v_cache.select(0, kv_slot[size_t(i)]);
      const at::Tensor& tables = group_tables[size_t(g)];  // (S, NBmax): this layer's group's
      const int64_t* blocks = slot_blocks.data_ptr<int64_t>() + g * T;
      // (T, (H + 2 Hkv) D): q|k|v of the normed input (OLMo 2: of the residual itself)
      linear_into(L.wqkv, pre_norm_ ? norm_into(x, L.input_norm, normed) : x, qkv);
      if (qk_norm_heads_ != 0) {  // each q and k head (or all of them at once) one row of the norm kernel
        const bool per_head = qk_norm_heads_ == 1;
        qk_norm(qkv, 0, h_, per_head, L.q_norm);
        qk_norm(qkv, qd, hkv_, per_head, L.k_norm);
      }
      if (L.rope >= 0) steady_ops::rope_(qkv, cos[size_t(L.rope)], sin[size_t(L.rope)], h_ + hkv_);
      const float* row = qkv.data_ptr<float>();  // k at column qd, v at qd + kvd of each row
      steady_ops::kv_write_rows(kc, vc, row + qd, row + qd + kvd, qkv.stride(0), T, hkv_, d_, blocks, offsets);
      at::Tensor q = qkv.narrow(1, 0, qd).contiguous().view({T, h_, d_});  // (T, H, D): a view at one row
      steady_ops::paged_attention(q, kc, vc, tables, seq_of, positions, attn, scale_, L.window, softcap_,
                                  L.sinks.defined() ? std::optional<at::Tensor>(L.sinks) : std::nullopt);
      linear_into(L.wo, attn.view({T, qd}), out);
      add_residual(x, out, L.attn_out_norm);
      if (L.experts) {  // a sparse layer: router and experts over every row at once (an expert's group is larger)
        steady_layers::sparse_block_into(*L.experts, pre_norm_ ? norm_into(x, L.post_norm, normed) : x, act_, out);
        add_residual(x, out, L.mlp_out_norm);
        continue;
      }
      for (int64_t r0 = 0; r0 < T; r0 += kMlpRows) {  // a slice of rows at a time, each updated in place
        const int64_t n = std::min(kMlpRows, T - r0);
        at::Tensor rows = x.narrow(0, r0, n), normed_rows = normed.narrow(0, r0, n), down = out.narrow(0, r0, n);
        at::Tensor gu = rows_of(gate_up, n, L.w_gate_up.n), a = rows_of(act, n, L.w_gate_up.n / 2);
        linear_into(L.w_gate_up, pre_norm_ ? norm_into(rows, L.post_norm, normed_rows) : rows, gu);
        steady_ops::gated_act_into(gu, -1, act_, a);
        linear_into(L.w_down, a, down);  // (n, hidden)
        add_residual(rows, down, L.mlp_out_norm);
      }
    }
    return x;
  }

 private:
  // Columns [col, col + heads D) of qkv normed in place, as Transformer._qkv does it: the slice reshaped to
  // one row per head (or one row for all heads), normed, and copied back.
  void qk_norm(at::Tensor& qkv, int64_t col, int64_t heads, bool per_head, const at::Tensor& weight) const {
    const int64_t T = qkv.size(0);
    at::Tensor part = qkv.narrow(1, col, heads * d_);
    at::Tensor normed = steady_ops::qrms_norm(part.reshape({T * (per_head ? heads : 1), -1}), weight, eps_, -1);
    part.copy_(normed.view({T, heads * d_}));
  }

  // x = norm(x) into y (returned), as qrms_norm computes it.
  const at::Tensor& norm_into(const at::Tensor& x, const at::Tensor& weight, at::Tensor& y) const {
    steady_ops::qrms_norm_into(x, weight, eps_, -1, y);
    return y;
  }

  // x += a block's output as its residual add takes it: normed (Gemma, OLMo 2), then scaled (Granite), each in
  // place in `out` (one exact operation per element, as on fresh tensors).
  void add_residual(at::Tensor& x, at::Tensor& out, const at::Tensor& norm) const {
    if (norm.defined()) steady_ops::qrms_norm_into(out, norm, eps_, -1, out);
    if (residual_scale_ != 1.0) out.mul_(residual_scale_);
    x.add_(out);
  }

  int64_t h_, hkv_, d_;
  double eps_, scale_, softcap_;  // softcap 0: none
  bool pre_norm_;
  int64_t qk_norm_heads_;
  steady_ops::GatedAct act_;
  double residual_scale_;
  std::vector<Layer> layers_;
  int64_t max_gate_up_ = 0;  // the widest gate|up of any layer: the MLP slices' buffers hold it
};

}  // namespace

namespace steady_ops {  // ops.h
void register_native_layers(torch::Library& m) {
  m.class_<NativeLayers>("NativeLayers")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, double, bool, int64_t, int64_t, double, double, double>())
      .def("add_layer", &NativeLayers::add_layer)
      .def("add_experts", &NativeLayers::add_experts)
      .def("num_layers", &NativeLayers::num_layers)
      .def("sparse_block", &NativeLayers::sparse_block)
      .def("forward", &NativeLayers::forward);
}
}  // namespace steady_ops
