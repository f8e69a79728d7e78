// Prints the same-run yardsticks alone: Eigen GEMM rate and the in-place pass bandwidth.
#include "common/bench.hpp"

int main() {
  using namespace k3::bench;
  print_header("yardsticks");
  int const nt = hardware_threads();
  gemm_yardstick gemm(nt);
  inplace_pass_yardstick pass(nt);
  std::vector<double> g, p;
  for (int i = 0; i < 7; ++i) {
    g.push_back(gemm.gflops());
    p.push_back(pass.gbps());
  }
  std::printf("eigen float GEMM 1024^3 x %d threads: median %.1f GFLOP/s\n", nt, median(g));
  std::printf("in-place read-then-write pass (%zu MiB, %d threads): median %.2f GB/s\n", pass.bytes() >> 20, nt, median(p));
}
