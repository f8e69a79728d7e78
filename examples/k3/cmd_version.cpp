// k3 version — library version, the SIMD ISA this binary was built for, CUDA architectures.
#include <cstdio>
#include <thread>

#include "cli.hpp"
#include "k3/backend/cpu/simd.hpp"
#include "k3/version.hpp"

namespace {

int run_version(k3::cli::args&) {
  std::printf("k3 %s\n", k3::version_string);
  std::printf("simd isa: %s\n", k3::simd::isa_name<xsimd::default_arch>());
  std::printf("hardware threads: %u\n", std::thread::hardware_concurrency());
#if defined(K3_CUDA_ARCHITECTURES)
  std::printf("cuda architectures: %s\n", K3_CUDA_ARCHITECTURES);
#else
  std::printf("cuda architectures: none (built without CUDA)\n");
#endif
  return 0;
}

k3::cli::registrar reg({"version", "print the library version, SIMD ISA and CUDA architectures", "", {{"help", false, "show this help"}},
                        false, run_version});

}  // namespace
