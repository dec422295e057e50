// The cap on the native kernels' vector build from STEADYSERVE_ISA (scalar | avx2 | avx512 | amx): a speed knob only,
// since every build computes the same bits (it lets one machine check them all). Read by both families'
// dispatch (qlinear.cpp, q8linear.cpp), so one setting caps both.
#pragma once

#include <cstdlib>
#include <string>

namespace steady_isa {

// 0 scalar, 1 AVX2, 2 AVX-512, 3 AMX (the int8 family's tiles): the widest build STEADYSERVE_ISA allows (3 when
// unset). The float32 family has no AMX build: its own best caps it at 2.
inline int env_cap() {
  const char* env = std::getenv("STEADYSERVE_ISA");
  if (!env) return 3;
  const std::string v(env);
  return v == "scalar" ? 0 : v == "avx2" ? 1 : v == "avx512" ? 2 : 3;
}

// F16C (with AVX), by CPUID. The f16 KV cache's conversions use it: reading (attention_rows.h) and writing
// (kv_write.cpp), each beside a portable conversion with the same bits.
inline bool cpu_has_f16c() { return __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c"); }

// Whether those conversions take F16C: the CPU has it and STEADYSERVE_ISA allows AVX2.
inline bool use_f16c() {
  static const bool ok = cpu_has_f16c() && env_cap() >= 1;
  return ok;
}

}  // namespace steady_isa
