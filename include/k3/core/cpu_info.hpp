// k3/core/cpu_info.hpp — who made the host CPU, for the few memory-tuning choices that go
// opposite ways by vendor (software prefetch and non-temporal stores in the streaming kernels
// help a server Xeon, whose single core keeps too few cache lines in flight on its own, and
// cost on AMD Zen 4; benchmarks/quant.md). Results never depend on it, only speed.
#pragma once

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#include <cpuid.h>
#define K3_CPU_INFO_X86 1
#endif

namespace k3::detail {

enum class cpu_vendor { other, intel, amd };

// The CPUID vendor string, read once.
inline cpu_vendor host_cpu_vendor() noexcept {
  static cpu_vendor const v = [] {
#if defined(K3_CPU_INFO_X86)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid(0, &a, &b, &c, &d) == 0) return cpu_vendor::other;
    if (b == 0x756E6547u && d == 0x49656E69u && c == 0x6C65746Eu) return cpu_vendor::intel;  // "GenuineIntel"
    if (b == 0x68747541u && d == 0x69746E65u && c == 0x444D4163u) return cpu_vendor::amd;    // "AuthenticAMD"
#endif
    return cpu_vendor::other;
  }();
  return v;
}

}  // namespace k3::detail
