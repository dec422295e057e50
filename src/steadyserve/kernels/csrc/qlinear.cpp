// torch ops over the matmul family (qmm.h): the GGUF block formats multiplied as stored.
//
//   qmatmul_(x, w, fmt, y, col0, isa)   y[:, col0 : col0 + N] = x · Wᵀ; a packed format id (q8.h: kPacked + a
//                                       GGML type) runs the int8 family (q8linear.cpp) instead
//   qdequant(w, fmt, K, rows, isa)      the fp32 values of the given weight rows (embedding lookups, tests)
//   qrms_norm(x, weight, eps, isa), qsilu_mul(gate_up, isa), qgelu_tanh_mul(gate_up, isa),
//   qswiglu_oai_mul(gate_up, alpha, limit, isa), qlog_softmax(x, isa)
//   qlog_softmax_(x, isa)               the same, in place: each output element is written after its row's
//                                       max and sum were read, from the input element at the same index
//   qargmax(x, isa)                     (T,) int64: each row's first NaN, else its first maximum (NumPy's argmax)
//
// `isa` picks the build: -1 the best this CPU has (by CPUID), 0 scalar, 1 AVX2, 2 AVX-512;
// the tests run all three and compare bits. Work is split over threads by output columns
// (matmul) or rows (the row-wise ops) only, so the thread count never changes a value.
#include "fp_env.h"
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "ops.h"
#include "isa.h"
#include "q8.h"
#include "qmm.h"

namespace {

using namespace steady_qmm;

int best_isa() { return steady_isa::best_float(); }

int pick_isa(int64_t isa) { return steady_isa::float_build(isa, "steadyserve float32 op"); }

// One build's entry points (qmm.h), indexed by ISA: 0 scalar, 1 AVX2, 2 AVX-512.
struct Build {
  decltype(&scalar::matmul) matmul;
  decltype(&scalar::dequant_rows) dequant_rows;
  decltype(&scalar::rms_norm) rms_norm;
  decltype(&scalar::silu_mul) silu_mul;
  decltype(&scalar::log_softmax) log_softmax;
  decltype(&scalar::gelu_tanh_mul) gelu_tanh_mul;
  decltype(&scalar::register_rows) register_rows;
  decltype(&scalar::argmax) argmax;
  decltype(&scalar::swiglu_oai_mul) swiglu_oai_mul;
};
const Build kBuilds[3] = {
    {scalar::matmul, scalar::dequant_rows, scalar::rms_norm, scalar::silu_mul, scalar::log_softmax, scalar::gelu_tanh_mul,
     scalar::register_rows, scalar::argmax, scalar::swiglu_oai_mul},
    {avx2::matmul, avx2::dequant_rows, avx2::rms_norm, avx2::silu_mul, avx2::log_softmax, avx2::gelu_tanh_mul,
     avx2::register_rows, avx2::argmax, avx2::swiglu_oai_mul},
    {avx512::matmul, avx512::dequant_rows, avx512::rms_norm, avx512::silu_mul, avx512::log_softmax, avx512::gelu_tanh_mul,
     avx512::register_rows, avx512::argmax, avx512::swiglu_oai_mul},
};

// Output columns per task: a multiple of every build's panel width, so a task boundary never
// splits a panel (it would not change bits, only speed).
constexpr int64_t kColumnsPerTask = 16;

}  // namespace

namespace steady_ops {  // ops.h; registered in bindings.cpp

int64_t qmm_isa() { return best_isa(); }

std::vector<int64_t> formats() {
  std::vector<int64_t> out;
  for (const steady_fmt::Traits& t : steady_fmt::kFormats) out.insert(out.end(), {t.ggml, t.block, t.bytes, t.bits});
  return out;
}

// Rows up to which the best build's matmul dequantizes each weight once in registers for all of them: a
// step of up to this many rows costs little more than one (speculative verification sizes itself by it).
int64_t qmm_register_rows() { return kBuilds[best_isa()].register_rows(); }

void qmatmul_(const at::Tensor& x, const at::Tensor& w, int64_t fmt, at::Tensor& y, int64_t col0, int64_t isa) {
  if (fmt >= steady_q8::kPacked) {  // weights packed for the int8 family (q8.h): activations go to int8
    steady_q8_ops::matmul_packed(x, w, fmt, y, col0, isa);
    return;
  }
  Layout lay;
  TORCH_CHECK(layout_of(int32_t(fmt), &lay), "qmatmul_: no kernel for GGML type ", fmt);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, "qmatmul_: x must be (M, K) float32");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), "qmatmul_: w must be contiguous (N, row_bytes) uint8");
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.dim() == 2 && y.stride(1) == 1, "qmatmul_: y must be (M, >= N) float32");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % lay.block == 0 && w.size(1) == K / lay.block * lay.bytes, "qmatmul_: K = ", K, " does not match the weight rows (",
              w.size(1), " bytes, ", lay.block, " weights per ", lay.bytes, " bytes)");
  TORCH_CHECK(y.size(0) == M && col0 >= 0 && col0 + N <= y.size(1), "qmatmul_: y is too small");
  const int use = pick_isa(isa);
  if (M == 0 || N == 0) return;
  MatmulArgs base{int32_t(fmt), x.data_ptr<float>(), x.stride(0), M, K, w.data_ptr<uint8_t>(), w.size(1),
                  y.data_ptr<float>() + col0, y.stride(0), 0, 0, nullptr};
  const int64_t tasks = (N + kColumnsPerTask - 1) / kColumnsPerTask;
  steady_fp::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scratch(M > 1 ? size_t(kScratchRows * K) : 0);
    MatmulArgs a = base;
    a.n_begin = t0 * kColumnsPerTask;
    a.n_end = std::min(N, t1 * kColumnsPerTask);
    a.scratch = scratch.data();
    kBuilds[use].matmul(a);
  });
}

at::Tensor qdequant(const at::Tensor& w, int64_t fmt, int64_t K, const at::Tensor& rows, int64_t isa) {
  Layout lay;
  TORCH_CHECK(layout_of(int32_t(fmt), &lay), "qdequant: no kernel for GGML type ", fmt);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), "qdequant: w must be contiguous (N, row_bytes) uint8");
  TORCH_CHECK(K % lay.block == 0 && w.size(1) == K / lay.block * lay.bytes, "qdequant: K does not match the weight rows");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "qdequant: rows must be (R,) int64");
  const at::Tensor r = rows.contiguous();
  const int64_t R = r.size(0), N = w.size(0);
  const int64_t* rp = r.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < N, "qdequant: row ", rp[i], " out of range [0, ", N, ")");
  at::Tensor out = at::empty({R, K}, w.options().dtype(at::kFloat));
  const int use = pick_isa(isa);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  steady_fp::parallel_for(0, R, 16, [&](int64_t i0, int64_t i1) {
    kBuilds[use].dequant_rows(int32_t(fmt), wp, w.size(1), K, rp + i0, i1 - i0, op + i0 * K);
  });
  return out;
}

// y = rms_norm(x) row by row into y (T, D) contiguous float32, which may be x itself: the kernel reads a row whole
// for its sum of squares before it writes any of it, then each element once.
void qrms_norm_into(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t isa, at::Tensor& y) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, "qrms_norm: x must be (T, D) float32");
  const int64_t T = x.size(0), D = x.size(1);
  TORCH_CHECK(D % 16 == 0, "qrms_norm: D must be a multiple of 16");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == D, "qrms_norm: weight must be (D,) float32");
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.dim() == 2 && y.size(0) == T && y.size(1) == D && y.is_contiguous(),
              "qrms_norm: y must be contiguous (T, D) float32");
  const int use = pick_isa(isa);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = float(eps);
  steady_fp::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    kBuilds[use].rms_norm(xp, x.stride(0), wp, e, D, yp, t0, t1);
  });
}

at::Tensor qrms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t isa) {
  TORCH_CHECK(x.dim() == 2, "qrms_norm: x must be (T, D) float32");
  at::Tensor y = at::empty({x.size(0), x.size(1)}, x.options());
  qrms_norm_into(x, weight, eps, isa, y);
  return y;
}

// y = act(gate) * up; y (T, I) contiguous float32.
void gated_act_into(const at::Tensor& gate_up, int64_t isa, const GatedAct& act, at::Tensor& y) {
  const char* name = act.kind == GatedAct::kGeluTanh ? "qgelu_tanh_mul"
                     : act.kind == GatedAct::kSwigluOai ? "qswiglu_oai_mul" : "qsilu_mul";
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat && gate_up.dim() == 2 && gate_up.is_contiguous(),
              name, ": gate_up must be contiguous (T, 2 * I) float32");
  const int64_t T = gate_up.size(0), I2 = gate_up.size(1);
  TORCH_CHECK(I2 % 32 == 0, name, ": I (half the width) must be a multiple of 16");
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.is_contiguous() && y.dim() == 2 && y.size(0) == T && y.size(1) == I2 / 2,
              name, ": y must be contiguous (T, I) float32");
  const int use = pick_isa(isa);
  const float* gp = gate_up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const Build& b = kBuilds[use];
  steady_fp::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    if (act.kind == GatedAct::kSwigluOai) b.swiglu_oai_mul(gp, I2 / 2, yp, t0, t1, act.alpha, act.limit);
    else (act.kind == GatedAct::kGeluTanh ? b.gelu_tanh_mul : b.silu_mul)(gp, I2 / 2, yp, t0, t1);
  });
}

namespace {
at::Tensor gated_act(const at::Tensor& gate_up, int64_t isa, const GatedAct& act) {
  TORCH_CHECK(gate_up.dim() == 2, "gated activation: gate_up must be contiguous (T, 2 * I) float32");
  at::Tensor y = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  gated_act_into(gate_up, isa, act, y);
  return y;
}
}  // namespace

at::Tensor qsilu_mul(const at::Tensor& gate_up, int64_t isa) { return gated_act(gate_up, isa, {GatedAct::kSilu}); }

at::Tensor qgelu_tanh_mul(const at::Tensor& gate_up, int64_t isa) {
  return gated_act(gate_up, isa, {GatedAct::kGeluTanh});
}

at::Tensor qswiglu_oai_mul(const at::Tensor& gate_up, double alpha, double limit, int64_t isa) {
  return gated_act(gate_up, isa, {GatedAct::kSwigluOai, static_cast<float>(alpha), static_cast<float>(limit)});
}

at::Tensor qlog_softmax(const at::Tensor& x, int64_t isa) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "qlog_softmax: x must be contiguous (T, V) float32");
  const int64_t T = x.size(0), V = x.size(1);
  at::Tensor y = at::empty({T, V}, x.options());
  const int use = pick_isa(isa);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  steady_fp::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    kBuilds[use].log_softmax(xp, V, yp, t0, t1);
  });
  return y;
}

at::Tensor qargmax(const at::Tensor& x, int64_t isa) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "qargmax: x must be contiguous (T, V) float32");
  const int64_t T = x.size(0), V = x.size(1);
  at::Tensor out = at::empty({T}, x.options().dtype(at::kLong));
  const int use = pick_isa(isa);
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  steady_fp::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) { kBuilds[use].argmax(xp, V, op, t0, t1); });
  return out;
}

void qlog_softmax_(at::Tensor& x, int64_t isa) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(), "qlog_softmax_: x must be contiguous (T, V) float32");
  const int64_t T = x.size(0), V = x.size(1);
  const int use = pick_isa(isa);
  float* xp = x.data_ptr<float>();
  steady_fp::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    kBuilds[use].log_softmax(xp, V, xp, t0, t1);
  });
}

}  // namespace steady_ops
