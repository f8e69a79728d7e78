// Prints the same-run yardsticks alone: Eigen GEMM rate and the in-place pass bandwidth.
#include "common/bench.hpp"

int main(int argc, char** argv) {
  using namespace k3::bench;
  csv_init(argc, argv);  // --csv FILE
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
  emit({"yardsticks", "eigen_gemm", "1024^3", "threads", "n=1024", 0, 0, median(g), "GFLOP/s", 0, "", 0, "", 0, nt});
  emit({"yardsticks", "inplace_pass", "256MiB", "threads", "bytes=268435456", 0, 0, median(p), "GB/s", 0, "", 0, "", 0, nt});
  std::printf("in-place read-then-write pass (%zu MiB, %d threads): median %.2f GB/s\n", pass.bytes() >> 20, nt, median(p));
}
