// The sparse mixture-of-experts block (moe.h) and its routing op (steadyserve::moe_route), op for op as
// models/moe.py computes them on the native paths, so a sparse layer run by NativeLayers has the per-op path's
// bits (tests/test_native_forward.py; tests/test_moe.py checks the routing against moe.py's on ties and NaN).
//
// Order of every floating-point operation, per row, each one IEEE float32 rounding (-ffp-contract=off):
//   logits  the router matrix through its family (linear_into: the float32 family's fixed order)
//   softmax m = max over E (exact); d_e = max(l_e - m, -87); e_e = fexp(d_e) (lanes_math.h's fexp_bounded, scalar,
//           op for op as moe.py's exp_fixed); s = fold(e): padded with +0 to a power of two, then halves added
//           elementwise ([i] + [i + half]) down to one; p_e = e_e / s
//   top-k   the k largest p by a stable descending sort: ties to the lower expert index, NaN above every number
//           (torch.sort's rule, so a NaN row routes as moe.py's does)
//   weights w_j = p of rank j; with norm_topk: w_j / fold(w_0 .. w_{k-1}), the same fold by rank
//   experts for each expert in ascending index, its rows (ascending token) through gate|up, act(gate)·up, down;
//           each output row times its weight (one rounding), then one add into the token's sum, which starts at +0
// A row's bits depend on its own logits and the kernels' per-row order only: never on which rows share a call.
#include "moe.h"

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

#include "fp_env.h"
#include "ops.h"

namespace {

constexpr float kExpLow = -87.0f;  // moe.py's EXP_LOW: fexp's domain here

// lanes_math.h's fexp_bounded on one float (the same constants and operations, in the same order).
float fexp(float x) {
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x log2 e), exact
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = (p * (r * r) + r) + 1.0f;
  if (std::isnan(n)) return y;  // NaN in, NaN out (the cast below would be undefined)
  const int32_t bits = (int32_t(n) + 127) << 23;  // 2^n, n in [-126, 0]
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// The sum of v[0, n) in moe.py's fold_sum tree; `pad` holds at least the next power of two of n.
float fold(const float* v, int64_t n, float* pad) {
  int64_t width = 1;
  while (width < n) width *= 2;
  for (int64_t i = 0; i < width; ++i) pad[i] = i < n ? v[i] : 0.0f;
  while (width > 1) {
    width /= 2;
    for (int64_t i = 0; i < width; ++i) pad[i] = pad[i] + pad[i + width];
  }
  return pad[0];
}

// Whether a ranks strictly before b in a descending sort that puts NaN first (equal values: neither).
bool before(float a, float b) { return (std::isnan(a) && !std::isnan(b)) || a > b; }

// One row: logits (E) -> weights (k) by rank, experts (k). scratch: 3 E floats.
void route_row(const float* logits, int64_t E, int64_t k, bool norm, float* weights, int64_t* experts,
               float* scratch) {
  float* p = scratch;
  float* pad = scratch + E;
  float m = logits[0];
  for (int64_t e = 1; e < E; ++e) m = std::isnan(m) || std::isnan(logits[e]) ? NAN : std::max(m, logits[e]);
  for (int64_t e = 0; e < E; ++e) {
    float d = logits[e] - m;
    p[e] = fexp(d < kExpLow ? kExpLow : d);  // NaN is kept, as torch.clamp keeps it
  }
  const float s = fold(p, E, pad);
  for (int64_t e = 0; e < E; ++e) p[e] = p[e] / s;
  for (int64_t j = 0; j < k; ++j) {  // selection by rank: the first of the equal-best among those not yet taken
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      bool taken = false;
      for (int64_t i = 0; i < j; ++i) taken = taken || experts[i] == e;
      if (!taken && (best < 0 || before(p[e], p[best]))) best = e;
    }
    experts[j] = best;
    weights[j] = p[best];
  }
  if (norm) {
    const float s_k = fold(weights, k, pad);
    for (int64_t j = 0; j < k; ++j) weights[j] = weights[j] / s_k;
  }
}

void check_logits(const at::Tensor& logits, int64_t top_k) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous(),
              "moe_route: logits must be contiguous (T, E) float32");
  TORCH_CHECK(top_k >= 1 && top_k <= logits.size(1), "moe_route: top_k = ", top_k, " is not in [1, E = ",
              logits.size(1), "]");
}

// Routes every row of logits (T, E) into weights (T, k) and experts (T, k); rows split between threads.
void route_rows(const at::Tensor& logits, int64_t k, bool norm, float* weights, int64_t* experts) {
  const int64_t T = logits.size(0), E = logits.size(1);
  const float* lp = logits.data_ptr<float>();
  steady_fp::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    std::vector<float> scratch(size_t(3 * E + k));
    for (int64_t t = t0; t < t1; ++t) route_row(lp + t * E, E, k, norm, weights + t * k, experts + t * k, scratch.data());
  });
}

}  // namespace

namespace steady_ops {

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, int64_t top_k, bool norm_topk_prob) {
  check_logits(logits, top_k);
  const int64_t T = logits.size(0);
  at::Tensor weights = at::empty({T, top_k}, logits.options());
  at::Tensor experts = at::empty({T, top_k}, logits.options().dtype(at::kLong));
  route_rows(logits, top_k, norm_topk_prob, weights.data_ptr<float>(), experts.data_ptr<int64_t>());
  return {weights, experts};
}

}  // namespace steady_ops

namespace steady_layers {

void sparse_block_into(const Experts& w, const at::Tensor& x, bool gelu, at::Tensor& out) {
  const int64_t T = x.size(0), E = int64_t(w.gate_up.size()), k = w.top_k;
  at::Tensor logits = at::empty({T, w.router.n}, x.options());
  linear_into(w.router, x, logits);
  check_logits(logits, k);
  std::vector<float> weights(size_t(T * k));
  std::vector<int64_t> experts(size_t(T * k));
  route_rows(logits, k, w.norm_topk, weights.data(), experts.data());
  // Each expert's (token, weight) pairs, tokens ascending: moe.py's stable argsort of the flat choices.
  std::vector<std::vector<int64_t>> rows(static_cast<size_t>(E));
  std::vector<std::vector<float>> scales(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = experts[size_t(t * k + j)];
      TORCH_CHECK(e >= 0 && e < E, "sparse block: expert ", e, " of ", E);
      rows[size_t(e)].push_back(t);
      scales[size_t(e)].push_back(weights[size_t(t * k + j)]);
    }
  }
  out.zero_();
  const auto opts = x.options();
  for (int64_t e = 0; e < E; ++e) {  // ascending expert index: each token's terms are added in that order
    const int64_t count = int64_t(rows[size_t(e)].size());
    if (count == 0) continue;
    at::Tensor index = at::from_blob(rows[size_t(e)].data(), {count}, opts.dtype(at::kLong));
    at::Tensor scale = at::from_blob(scales[size_t(e)].data(), {count, 1}, opts);
    at::Tensor xe = x.index_select(0, index);  // (count, hidden)
    at::Tensor gu = at::empty({count, w.gate_up[size_t(e)].n}, opts);
    linear_into(w.gate_up[size_t(e)], xe, gu);
    at::Tensor act = at::empty({count, w.gate_up[size_t(e)].n / 2}, opts);
    steady_ops::gated_act_into(gu, -1, gelu, act);
    at::Tensor y = at::empty({count, w.down[size_t(e)].n}, opts);
    linear_into(w.down[size_t(e)], act, y);
    out.index_add_(0, index, y.mul_(scale));  // its weight, then one add per element
  }
}

}  // namespace steady_layers
