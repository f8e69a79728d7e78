// k3/core/arch/tags.hpp — the target architectures as types: a kernel written for a tag serves
// every target derived from it, and overload resolution picks the most derived one (as xsimd's
// architecture tags do for SIMD instruction sets). k3::detail::target::tag is the one compiled for.
#pragma once

// The one place that reads the target macros: each file of this folder is empty unless its
// macro is set (generic.hpp: unless none is).
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || (defined(__i386__) && defined(__SSE__)))
#define K3_TARGET_X86_64 1
#elif (defined(__GNUC__) || defined(__clang__)) && defined(__aarch64__)
#define K3_TARGET_AARCH64 1
#endif

namespace k3::detail::target {

struct generic_tag {};
struct x86_64_tag : generic_tag {};
struct aarch64_tag : generic_tag {};

}  // namespace k3::detail::target
