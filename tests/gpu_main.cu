// The doctest main for GPU tests: exits 77 (ctest: skipped) when no CUDA device exists,
// except when doctest is only asked to list tests.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <cstring>
#include <cuda_runtime.h>

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
  return ctx.run();
}
