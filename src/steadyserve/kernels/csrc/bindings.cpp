// The one registration file: every op of the `steadyserve` torch library, by the C++ function ops.h declares.
//
// Each op runs under the fixed floating-point environment (fp_env.h): Pinned wraps the function so MXCSR is set on
// entry and restored on exit on the calling thread, and the kernels' parallel loops set it on their workers. Ops that
// exist only to check one kernel alone against a reference are registered by a separate library the tests load
// (testing/test_ops.cpp, build.load_test_ops), not by this one.
#include <torch/library.h>

#include "fp_env.h"
#include "ops.h"

#define STEADY_IMPL(name, fn) m.impl(name, c10::DispatchKey::CPU, TORCH_FN(steady_fp::Pinned<&fn>::call))

TORCH_LIBRARY(steadyserve, m) {
  using namespace steady_ops;
  using namespace steady_q8_ops;
  // Which builds run (isa.h); no tensors, so no dispatch key.
  m.def("qmm_isa() -> int", TORCH_FN(qmm_isa));
  m.def("q8_isa() -> int", TORCH_FN(q8_isa));
  m.def("attention_isa(bool q8_cache) -> int", TORCH_FN(attention_isa));
  m.def("qmm_register_rows() -> int", TORCH_FN(qmm_register_rows));
  m.def("formats() -> int[]", TORCH_FN(formats));  // formats.h: kernels/quant.py's table is checked against it

  // Matmuls: the float32 family and, for packed format ids, the int8 family.
  m.def("qmatmul_(Tensor x, Tensor w, int fmt, Tensor(a!) y, int col0, int isa=-1) -> ()");
  STEADY_IMPL("qmatmul_", qmatmul_);
  m.def("q8matmul_residual_(Tensor x, Tensor w, int fmt, Tensor(a!) y, int col0, float margin, int max_panels, int isa=-1) -> ()");
  STEADY_IMPL("q8matmul_residual_", q8matmul_residual_);
  m.def("qdequant(Tensor w, int fmt, int K, Tensor rows, int isa=-1) -> Tensor");
  STEADY_IMPL("qdequant", qdequant);
  m.def("q8pack(Tensor w, int fmt, int K) -> Tensor");
  STEADY_IMPL("q8pack", q8pack);

  // Row-wise ops.
  m.def("qrms_norm(Tensor x, Tensor weight, float eps, int isa=-1) -> Tensor");
  STEADY_IMPL("qrms_norm", qrms_norm);
  m.def("qsilu_mul(Tensor gate_up, int isa=-1) -> Tensor");
  STEADY_IMPL("qsilu_mul", qsilu_mul);
  m.def("qswiglu_oai_mul(Tensor gate_up, float alpha, float limit, int isa=-1) -> Tensor");
  STEADY_IMPL("qswiglu_oai_mul", qswiglu_oai_mul);
  m.def("qgelu_tanh_mul(Tensor gate_up, int isa=-1) -> Tensor");
  STEADY_IMPL("qgelu_tanh_mul", qgelu_tanh_mul);
  m.def("qlog_softmax_(Tensor(a!) x, int isa=-1) -> ()");
  STEADY_IMPL("qlog_softmax_", qlog_softmax_);
  m.def("qargmax(Tensor x, int isa=-1) -> Tensor");
  STEADY_IMPL("qargmax", qargmax);
  m.def("softcap_(Tensor(a!) x, float cap) -> ()");
  STEADY_IMPL("softcap_", softcap_);
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin, int num_heads) -> ()");
  STEADY_IMPL("rope_", rope_);

  // Attention and the KV cache.
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_of, "
        "Tensor positions, Tensor(a!) out, float scale, int window, float softcap=0.0, Tensor? sinks=None) -> ()");
  STEADY_IMPL("paged_attention", paged_attention);
  m.def("kv_write(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor slot_blocks, "
        "Tensor slot_offsets) -> ()");
  STEADY_IMPL("kv_write", kv_write);

  // A sparse block's routing (the one NativeLayers runs), for its tests against models/moe.py's.
  m.def("moe_route(Tensor logits, int top_k, bool norm_topk_prob, bool topk_softmax=False) -> (Tensor, Tensor)");
  STEADY_IMPL("moe_route", moe_route);

  // The decoder layers in one native call.
  register_native_layers(m);
}
