// A sparse mixture-of-experts block in native code (moe.cpp), for forward.cpp's layers: models/moe.py's
// moe_block, op for op, with the same bits.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "matrix.h"

namespace steady_layers {

// One sparse layer's weights and what its block computes (models/moe.py's MoeWeights and MoeSpec).
struct Experts {
  Matrix router;                // (E, hidden): the float32 family (never repacked: moe.py's docstring)
  std::vector<Matrix> gate_up;  // E matrices of (2 I, hidden): gate rows, then up rows
  std::vector<Matrix> down;     // E matrices of (hidden, I)
  int64_t top_k = 0;            // experts a token uses
  bool norm_topk = false;       // the k chosen probabilities divided by their sum
  bool topk_softmax = false;    // gpt-oss: the k largest logits first, then the softmax over those k
  int64_t width = 0;            // I: each expert's SwiGLU width
};

// out (T, hidden) = the block on normed rows x (T, hidden); out is overwritten. act: the experts' activation.
void sparse_block_into(const Experts& w, const at::Tensor& x, const steady_ops::GatedAct& act, at::Tensor& out);

}  // namespace steady_layers
