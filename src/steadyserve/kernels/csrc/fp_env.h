// The floating-point environment every kernel body runs in, and the parallel loop that sets it on each thread.
//
// The reduction orders (q8.h, qmm.h, paged_attention.cpp) are IEEE operations under SSE's default MXCSR:
// round to nearest even, flush-to-zero and denormals-are-zero off. MXCSR is per thread and anything in the
// process may change it (torch.set_flush_denormal, a library built with -ffast-math setting FTZ/DAZ in its
// constructor), and at::parallel_for runs chunk 0 on the calling thread and the rest on OpenMP workers, whose
// MXCSR can differ from the caller's. So a value touching a subnormal could change with the thread split. Every
// op (bindings.cpp) and every chunk of every parallel loop (parallel_for below) runs under kMxcsr instead, set
// on entry and restored on exit; the exception flags (bits 0-5) are left as they were.
#pragma once

#include <ATen/Parallel.h>
#include <xmmintrin.h>

#include <cstdint>
#include <utility>

namespace steady_fp {

// All six exceptions masked (bits 7-12), round to nearest (bits 13-14 = 0), FTZ (bit 15) and DAZ (bit 6) off.
constexpr unsigned kMxcsr = 0x1F80u;
constexpr unsigned kFlags = 0x3Fu;  // the sticky exception flags: not part of the environment we pin

// Sets kMxcsr for its lifetime on the calling thread; restores the caller's on exit (writes only when it differs).
class Scope {
 public:
  Scope() : saved_(_mm_getcsr()) {
    if ((saved_ & ~kFlags) != kMxcsr) _mm_setcsr(kMxcsr | (saved_ & kFlags));
  }
  ~Scope() {
    if ((saved_ & ~kFlags) != kMxcsr) _mm_setcsr(saved_ | (_mm_getcsr() & kFlags));
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  unsigned saved_;
};

// at::parallel_for with each chunk under Scope, on whichever thread runs it. Kernels use this, never the
// bare at::parallel_for (tests/test_kernel_library.py checks the sources).
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
    Scope scope;
    f(b, e);
  });
}

// A function F run under Scope: what bindings.cpp registers for each op (Pinned<&fn>::call), so the calling thread's
// part of an op runs in the pinned environment too.
template <auto F>
struct Pinned;

template <class R, class... A, R (*F)(A...)>
struct Pinned<F> {
  static R call(A... args) {
    const Scope scope;
    return F(std::forward<A>(args)...);
  }
};

}  // namespace steady_fp
