// The doctest main for GPU tests. Under nvcc: exits 77 (ctest: skipped) when no CUDA device
// exists, except when doctest is only asked to list tests. Under k3's SIMT host runtime: runs
// the kernels on the CPU, then prints how often each kernel ran and, when K3_SIMT_LAUNCH_LOG
// names a file, appends the same lines to it (CI sums them into a table per kernel).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "k3/backend/cuda/config.cuh"

int main(int argc, char** argv) {
  bool listing = false;
  for (int i = 1; i < argc; ++i)
    if (std::strncmp(argv[i], "--list", 6) == 0 || std::strncmp(argv[i], "-l", 2) == 0) listing = true;
  int devices = 0;
  if (!listing && (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0)) {
    std::printf("no CUDA device: skipping\n");
    return 77;
  }
  doctest::Context ctx(argc, argv);
  int const rc = ctx.run();
#if defined(K3_SIMT_RUNTIME)
  if (!listing) {
    std::FILE* log = nullptr;
    if (char const* path = std::getenv("K3_SIMT_LAUNCH_LOG")) log = std::fopen(path, "a");
    for (auto const& r : k3::simt::launch_records()) {
      std::printf("k3 SIMT runtime ran %llu launches, %llu blocks: %s\n", static_cast<unsigned long long>(r.launches),
                  static_cast<unsigned long long>(r.blocks), r.kernel.c_str());
      if (log) std::fprintf(log, "%llu\t%llu\t%s\n", static_cast<unsigned long long>(r.launches), static_cast<unsigned long long>(r.blocks), r.kernel.c_str());
    }
    if (log) std::fclose(log);
  }
#endif
  return rc;
}
