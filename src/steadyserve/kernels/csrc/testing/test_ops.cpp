// The ops that exist only for the tests: each runs one kernel alone so a test can hold it to a reference (every
// build's activation quantization, the out-of-place log-softmax, the f16 cache's two conversions). Built into a
// library of its own that links the production one (build.load_test_ops), so a server never registers them. The
// functions are the production library's (ops.h); this file only registers them, as bindings.cpp does.
#include <torch/library.h>

#include "../fp_env.h"
#include "../ops.h"

#define STEADY_IMPL(name, fn) m.impl(name, c10::DispatchKey::CPU, TORCH_FN(steady_fp::Pinned<&fn>::call))

TORCH_LIBRARY_FRAGMENT(steadyserve, m) {
  using namespace steady_ops;
  using namespace steady_q8_ops;
  m.def("q8quantize(Tensor x, int isa=-1) -> (Tensor, Tensor)");
  STEADY_IMPL("q8quantize", q8quantize);
  m.def("qlog_softmax(Tensor x, int isa=-1) -> Tensor");
  STEADY_IMPL("qlog_softmax", qlog_softmax);
  m.def("kv_halves_to_floats(Tensor h, int isa=-1) -> Tensor");
  STEADY_IMPL("kv_halves_to_floats", kv_halves_to_floats);
  m.def("kv_floats_to_halves(Tensor x, int isa=-1) -> Tensor");
  STEADY_IMPL("kv_floats_to_halves", kv_floats_to_halves);
}
