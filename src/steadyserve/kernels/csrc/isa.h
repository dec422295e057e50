// The one owner of what the CPU can run: CPU detection, the OS grants, and the STEADYSERVE_ISA cap.
//
// Builds, by index (the value q8_isa() / qmm_isa() report and every `isa` argument takes):
//   0 scalar   plain C++: the reference every other build is tested against, bitwise
//   1 avx2     AVX2 + FMA + F16C (x86-64-v3)
//   2 avx512   AVX-512 F/BW/DQ/VL beside build 1's features; the int8 family also needs AVX512_VNNI for it
//   3 amx      the int8 family only: AMX-TILE + AMX-INT8 beside build 2, with the tile state granted by the OS
// Every build of a family computes the same bits, so the choice is speed only; STEADYSERVE_ISA=scalar|avx2|avx512|amx
// caps it (one machine can then check them all), and any other value is an error naming these.
//
// CPUID comes from libgcc's __builtin_cpu_supports, which also checks XGETBV: a feature whose register state the
// OS does not save (YMM, ZMM) is reported absent. AMX's tile data is granted per process on request (Linux
// arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); a refusal (an old kernel, a sandbox) leaves build 2.
// Nothing else in the kernels asks the CPU or reads the variable (tests/test_kernel_library.py checks the sources).
#pragma once

#include <c10/util/Exception.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>

namespace steady_isa {

enum Build : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAmx = 3 };
inline const char* build_name(int b) {
  static const char* const names[] = {"scalar", "avx2", "avx512", "amx"};
  return b >= 0 && b <= kAmx ? names[b] : "?";
}

// What CPUID (and the OS, through XGETBV) reports, read once.
struct Cpu {
  bool avx2;    // AVX2 + FMA + F16C (with AVX)
  bool avx512;  // AVX-512 F, BW, DQ, VL, beside build 1's features
  bool vnni;    // AVX512_VNNI
  bool amx;     // AMX-TILE + AMX-INT8 (CPUID leaf 7, EDX bits 24 and 25); the OS grant is amx_granted()
  bool amd;     // the vendor is AMD: only prefetch distances depend on it (q8linear.cpp), never a value
};

inline const Cpu& cpu() {
  static const Cpu c = [] {
    __builtin_cpu_init();
    Cpu r{};
    r.avx2 = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx2") &&
             __builtin_cpu_supports("fma");
    r.avx512 = r.avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    r.vnni = r.avx512 && __builtin_cpu_supports("avx512vnni");
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    r.amd = __builtin_cpu_is("amd");
    r.amx = r.vnni && __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && ((edx >> 24) & 1) && ((edx >> 25) & 1);
    return r;
  }();
  return c;
}

// The widest build STEADYSERVE_ISA allows (kAmx when unset); an unknown value is an error naming the allowed ones.
inline int cap() {
  static const int c = [] {
    const char* env = std::getenv("STEADYSERVE_ISA");
    if (!env || !*env) return int(kAmx);
    const std::string v(env);
    for (int b = kScalar; b <= kAmx; ++b)
      if (v == build_name(b)) return b;
    TORCH_CHECK(false, "STEADYSERVE_ISA=", v, " is not a build: use scalar, avx2, avx512 or amx (or leave it unset)");
    return 0;
  }();
  return c;
}

// Asks the OS for the tile state once; only where the CPU has AMX and the cap allows its use.
inline bool amx_granted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return cpu().amx && cap() >= kAmx && syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

// The float32 family's widest build (qlinear.cpp): it has no AMX build.
inline int best_float() {
  const int have = cpu().avx512 ? kAvx512 : cpu().avx2 ? kAvx2 : kScalar;
  return have < cap() ? have : cap();
}

// The attention family's widest build for a cache (paged_attention.cpp): best_float(), except that a q8_0 cache's
// integer scores need AVX512_VNNI in the avx512 build (attention_q8_avx512.cpp), so an AVX-512 CPU without it runs
// the avx2 build for that format. Every build gives the same bits.
inline int best_attention(bool q8_cache) {
  const int b = best_float();
  return q8_cache && b == kAvx512 && !cpu().vnni ? int(kAvx2) : b;
}

// The int8 family's widest build (q8linear.cpp).
inline int best_int8() {
  const int have = cpu().vnni ? (amx_granted() ? kAmx : kAvx512) : cpu().avx2 ? kAvx2 : kScalar;
  return have < cap() ? have : cap();
}

// The build an op runs for its `isa` argument (the tests pick one; -1: the widest allowed): refused, naming the op,
// where it is not a build of the family or the CPU (or the cap) does not allow it.
inline int pick(int64_t isa, int best, int last, const char* op) {
  TORCH_CHECK(isa >= -1 && isa <= last, op, ": isa must be -1 (auto) or a build from 0 (scalar) to ", last, " (",
              build_name(last), "), not ", isa);
  TORCH_CHECK(isa <= best, op, ": this CPU cannot run the ", build_name(int(isa)), " build (best here: ",
              build_name(best), ")");
  return isa < 0 ? best : int(isa);
}
inline int float_build(int64_t isa, const char* op) { return pick(isa, best_float(), kAvx512, op); }
inline int int8_build(int64_t isa, const char* op) { return pick(isa, best_int8(), kAmx, op); }

}  // namespace steady_isa
