// Quickstart demo: runs on built-in K3-shaped defaults. (The KDA layer lands with issue 3.)
#include <cstdio>

#include "k3/backend/cpu/simd.hpp"
#include "k3/version.hpp"

int main() {
  std::printf("k3 %s quickstart (simd isa: %s)\n", k3::version_string, k3::simd::isa_name<xsimd::default_arch>());
  return 0;
}
