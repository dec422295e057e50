// One weight matrix of a layer as the native layer code holds it (forward.cpp, moe.cpp): stored parts stacked by
// rows, each in its own format, computed into one output as QMatrix.__call__ and Transformer._linear do.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "ops.h"

namespace steady_layers {

struct Matrix {
  std::vector<at::Tensor> parts;  // (N_i, row_bytes) uint8: GGML blocks or int8 panels
  std::vector<int64_t> fmts;      // the format id of each part (a GGML type, or kPacked + one)
  int64_t n = 0;                  // rows in all: the output width
  at::Tensor bias;                // (n,) float32, or undefined
};

// Appends parts[next, next + count) to m; returns the index after them.
inline size_t take_parts(Matrix& m, const std::vector<at::Tensor>& parts, const std::vector<int64_t>& fmts,
                         size_t next, int64_t count, const char* who) {
  for (int64_t i = 0; i < count; ++i, ++next) {
    TORCH_CHECK(next < parts.size() && next < fmts.size(), who, ": fewer parts than the counts say");
    m.parts.push_back(parts[next]);
    m.fmts.push_back(fmts[next]);
    m.n += parts[next].size(0);
  }
  return next;
}

// y = x · Wᵀ (+ b): parts left to right into one output, then the bias added elementwise. y: (M, n) with unit
// column stride.
inline void linear_into(const Matrix& w, const at::Tensor& x, at::Tensor& y) {
  int64_t col = 0;
  for (size_t i = 0; i < w.parts.size(); ++i) {
    steady_ops::qmatmul_(x, w.parts[i], w.fmts[i], y, col, -1);
    col += w.parts[i].size(0);
  }
  if (w.bias.defined()) y.add_(w.bias);
}

}  // namespace steady_layers
