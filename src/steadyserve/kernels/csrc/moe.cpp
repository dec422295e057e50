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
//   (gpt-oss, topk_softmax: the top-k by the same sort on the logits themselves, then the softmax above over
//   those k logits by rank: m = max of the k, e_j = fexp(max(l_j - m, -87)), w_j = e_j / fold(e))
//   experts for each expert in ascending index, its rows (ascending token) through gate|up (+ bias), act(gate)·up,
//           down (+ bias; each bias one exact add per element after its matmul);
//           each output row times its weight (one rounding), then one add into the token's sum, which starts at +0
//           (the pairs go in slices of kPairs, in that same order, so slicing moves no add)
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
#include "q8.h"

namespace {

constexpr float kExpLow = -87.0f;  // moe.py's EXP_LOW: fexp's domain here

// lanes_math.h's fexp_bounded on one float (the same constants and operations, in the same order), written out
// because only a build file includes the lanes (tests/test_kernel_library.py); test_moe.py holds it to exp_fixed.
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

// p[0, n) = the softmax of v[0, n) in moe.py's order (exact max with NaN kept, fexp, the fold, one division each).
void softmax_into(const float* v, int64_t n, float* p, float* pad) {
  float m = v[0];
  for (int64_t e = 1; e < n; ++e) m = std::isnan(m) || std::isnan(v[e]) ? NAN : std::max(m, v[e]);
  for (int64_t e = 0; e < n; ++e) {
    float d = v[e] - m;
    p[e] = fexp(d < kExpLow ? kExpLow : d);  // NaN is kept, as torch.clamp keeps it
  }
  const float s = fold(p, n, pad);
  for (int64_t e = 0; e < n; ++e) p[e] = p[e] / s;
}

// experts[0, k) = the k best of v[0, E) by rank: the first of the equal-best among those not yet taken.
void top_k(const float* v, int64_t E, int64_t k, int64_t* experts) {
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      bool taken = false;
      for (int64_t i = 0; i < j; ++i) taken = taken || experts[i] == e;
      if (!taken && (best < 0 || before(v[e], v[best]))) best = e;
    }
    experts[j] = best;
  }
}

// One row: logits (E) -> weights (k) by rank, experts (k). scratch: E floats, then fold's pad (up to 2 E), then k.
void route_row(const float* logits, int64_t E, int64_t k, bool norm, bool topk_softmax, float* weights,
               int64_t* experts, float* scratch) {
  float* p = scratch;
  float* pad = scratch + E;
  if (topk_softmax) {  // gpt-oss: the k largest logits, then their softmax (the weights sum to 1 by construction)
    top_k(logits, E, k, experts);
    float* chosen = pad + 2 * E;
    for (int64_t j = 0; j < k; ++j) chosen[j] = logits[experts[j]];
    softmax_into(chosen, k, weights, pad);
    return;
  }
  softmax_into(logits, E, p, pad);
  top_k(p, E, k, experts);
  for (int64_t j = 0; j < k; ++j) weights[j] = p[experts[j]];
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
void route_rows(const at::Tensor& logits, int64_t k, bool norm, bool topk_softmax, float* weights, int64_t* experts) {
  const int64_t T = logits.size(0), E = logits.size(1);
  const float* lp = logits.data_ptr<float>();
  steady_fp::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    std::vector<float> scratch(size_t(3 * E + k));
    for (int64_t t = t0; t < t1; ++t)
      route_row(lp + t * E, E, k, norm, topk_softmax, weights + t * k, experts + t * k, scratch.data());
  });
}

}  // namespace

namespace steady_ops {

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& logits, int64_t top_k, bool norm_topk_prob,
                                              bool topk_softmax) {
  check_logits(logits, top_k);
  const int64_t T = logits.size(0);
  at::Tensor weights = at::empty({T, top_k}, logits.options());
  at::Tensor experts = at::empty({T, top_k}, logits.options().dtype(at::kLong));
  route_rows(logits, top_k, norm_topk_prob, topk_softmax, weights.data_ptr<float>(), experts.data_ptr<int64_t>());
  return {weights, experts};
}

}  // namespace steady_ops

namespace steady_layers {

namespace {

// The packed format every expert's matrix has as its one part (gate|up joined: QMatrix.packed), or -1.
int64_t one_packed_format(const std::vector<Matrix>& ms) {
  const int64_t fmt = ms[0].fmts.size() == 1 ? ms[0].fmts[0] : -1;
  for (const Matrix& m : ms) {
    if (m.parts.size() != 1 || m.fmts[0] != fmt) return -1;
  }
  return fmt >= steady_q8::kPacked ? fmt : -1;
}

// Each group's rows of y plus its expert's bias (gpt-oss), as linear_into adds it: one exact add per element.
void add_group_biases(const std::vector<Matrix>& ms, const std::vector<int64_t>& group_experts,
                      const std::vector<int64_t>& bounds, at::Tensor& y) {
  for (size_t g = 0; g < group_experts.size(); ++g) {
    const Matrix& m = ms[size_t(group_experts[g])];
    if (m.bias.defined()) y.narrow(0, bounds[g], bounds[g + 1] - bounds[g]).add_(m.bias);
  }
}

// Pairs (token, expert) per pass: a long prompt's T k pairs go through the experts in slices of this many, in
// expert order (an expert whose rows straddle a slice boundary is read once more, once per boundary), so an
// expert's weights are read about once per prompt while the slice's buffers
// (kPairs (2 hidden + 3 I) floats: 25 MiB at Qwen3-30B-A3B's widths) stay reused from call to call instead of
// faulting in fresh pages for every layer.
constexpr int64_t kPairs = 1024;

// The calling thread's buffers for one slice of pairs, grown to the largest slice it has run.
struct Slice {
  std::vector<float> data;
  float *xs = nullptr, *gu = nullptr, *act = nullptr, *ys = nullptr;  // (n, H), (n, 2I), (n, I), (n, H)
};
Slice& slice_buffers(int64_t n, int64_t H, int64_t I2) {
  thread_local Slice s;
  const size_t need = size_t(n * (2 * H + I2 + I2 / 2));
  if (s.data.size() < need) s.data.resize(need);
  s.xs = s.data.data();
  s.gu = s.xs + n * H;
  s.act = s.gu + n * I2;
  s.ys = s.act + n * I2 / 2;
  return s;
}

// The slice's pairs through their experts: rows tokens[0, n) of x (n = bounds.back()), pairs [bounds[g],
// bounds[g + 1]) through expert group_experts[g]; returns their outputs (n, H), in the thread's Slice. The int8
// path runs every expert of the slice in one call per matrix (matmul_packed_groups); otherwise one at a time.
const float* experts_into(const Experts& w, const at::Tensor& x, const steady_ops::GatedAct& act_kind,
                          const int64_t* tokens,
                          const std::vector<int64_t>& group_experts, const std::vector<int64_t>& bounds) {
  const int64_t n = bounds.back(), H = x.size(1), I2 = w.gate_up[0].n;
  Slice& s = slice_buffers(n, H, I2);
  const float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) std::memcpy(s.xs + i * H, xp + tokens[i] * x.stride(0), size_t(H) * sizeof(float));
  const auto opts = x.options();
  at::Tensor xs = at::from_blob(s.xs, {n, H}, opts), gu = at::from_blob(s.gu, {n, I2}, opts);
  at::Tensor act = at::from_blob(s.act, {n, I2 / 2}, opts), ys = at::from_blob(s.ys, {n, H}, opts);
  const int64_t fmt_gu = one_packed_format(w.gate_up), fmt_down = one_packed_format(w.down);
  if (fmt_gu >= 0 && fmt_down >= 0) {
    std::vector<at::Tensor> wg, wd;
    for (int64_t e : group_experts) {
      wg.push_back(w.gate_up[size_t(e)].parts[0]);
      wd.push_back(w.down[size_t(e)].parts[0]);
    }
    steady_q8_ops::matmul_packed_groups(xs, wg, fmt_gu, bounds, gu);
    add_group_biases(w.gate_up, group_experts, bounds, gu);
    steady_ops::gated_act_into(gu, -1, act_kind, act);
    steady_q8_ops::matmul_packed_groups(act, wd, fmt_down, bounds, ys);
    add_group_biases(w.down, group_experts, bounds, ys);
    return s.ys;
  }
  for (size_t g = 0; g < group_experts.size(); ++g) {
    const int64_t a = bounds[g], count = bounds[g + 1] - a, e = group_experts[g];
    at::Tensor gg = gu.narrow(0, a, count), aa = act.narrow(0, a, count), yy = ys.narrow(0, a, count);
    linear_into(w.gate_up[size_t(e)], xs.narrow(0, a, count), gg);
    steady_ops::gated_act_into(gg, -1, act_kind, aa);
    linear_into(w.down[size_t(e)], aa, yy);
  }
  return s.ys;
}

}  // namespace

void sparse_block_into(const Experts& w, const at::Tensor& x, const steady_ops::GatedAct& act, at::Tensor& out) {
  const int64_t T = x.size(0), H = x.size(1), E = int64_t(w.gate_up.size()), k = w.top_k;
  TORCH_CHECK(out.dim() == 2 && out.size(0) == T && out.size(1) == w.down[0].n && out.stride(1) == 1,
              "sparse block: out must be (T, hidden) with unit column stride");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, "sparse block: x must be (T, hidden) float32");
  at::Tensor logits = at::empty({T, w.router.n}, x.options());
  linear_into(w.router, x, logits);
  check_logits(logits, k);
  std::vector<float> weights(size_t(T * k));
  std::vector<int64_t> experts(size_t(T * k));
  route_rows(logits, k, w.norm_topk, w.topk_softmax, weights.data(), experts.data());
  // The (token, weight) pairs grouped by expert, ascending, tokens ascending inside a group: moe.py's stable
  // argsort of the flat choices. starts[e]: expert e's first pair.
  std::vector<int64_t> starts(size_t(E) + 1, 0);
  for (int64_t i = 0; i < T * k; ++i) {
    const int64_t e = experts[size_t(i)];
    TORCH_CHECK(e >= 0 && e < E, "sparse block: expert ", e, " of ", E);
    ++starts[size_t(e) + 1];
  }
  for (int64_t e = 0; e < E; ++e) starts[size_t(e) + 1] += starts[size_t(e)];
  std::vector<int64_t> tokens(size_t(T * k)), next(starts.begin(), starts.end() - 1);
  std::vector<float> scale(size_t(T * k));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t p = next[size_t(experts[size_t(t * k + j)])]++;
      tokens[size_t(p)] = t;
      scale[size_t(p)] = weights[size_t(t * k + j)];
    }
  }
  out.zero_();
  const int64_t P = T * k;
  for (int64_t p0 = 0; p0 < P; p0 += kPairs) {  // in pair order, so each token's terms stay in expert order
    const int64_t p1 = std::min(P, p0 + kPairs);
    std::vector<int64_t> group_experts, bounds{0};  // the experts with pairs in [p0, p1), and where theirs start
    for (int64_t e = 0; e < E; ++e) {
      const int64_t a = std::max(p0, starts[size_t(e)]), b = std::min(p1, starts[size_t(e) + 1]);
      if (a >= b) continue;
      group_experts.push_back(e);
      bounds.push_back(b - p0);
    }
    const float* yp = experts_into(w, x, act, tokens.data() + p0, group_experts, bounds);
    // Each pair's term into its token, in pair order: weight * y rounded, then one add, per element (threads
    // split the columns, never a token's chain)
    float* op = out.data_ptr<float>();
    const int64_t os = out.stride(0);
    steady_fp::parallel_for(0, H, 256, [&](int64_t h0, int64_t h1) {
      for (int64_t p = p0; p < p1; ++p) {
        float* o = op + tokens[size_t(p)] * os;
        const float* y = yp + (p - p0) * H;
        const float s = scale[size_t(p)];
        for (int64_t h = h0; h < h1; ++h) o[h] = o[h] + y[h] * s;
      }
    });
  }
}

}  // namespace steady_layers
