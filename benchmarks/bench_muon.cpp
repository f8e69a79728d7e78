// Muon's NS5 (k3::optim::newton_schulz) on a K3-like set of matrices, scaled to fit this
// machine: GFLOP/s (the GEMM FLOPs of newton_schulz_flops) as a ratio against the same-run Eigen
// GEMM rate (gemm_yardstick: one 1024^3 float GEMM per thread, all threads at once), medians of
// interleaved runs. A stack of one matrix per thread runs whole matrices on threads; a single
// matrix splits its products' panels over the threads. Then P2P Muon's plan on K3's matrix set
// (attention projections per head, routed experts): bytes received per rank against the
// all-gather's, at 8 and 32 ranks (counted from the plan, no MPI needed).
//   usage: bench_muon [repetitions (default 5)]
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "common/bench.hpp"
#include "k3/backend/cpu/simd.hpp"
#include "k3/optim.hpp"

namespace {

using k3::index_t;
namespace optim = k3::optim;

struct ns_case {
  char const* name;
  index_t M, A, B, heads;
  bool bf16;
};

template <class T>
double run_ns(k3::cpu::threads<> const& cpu, std::vector<T> const& g, std::vector<T>& o, ns_case const& c) {
  return k3::bench::seconds([&] {
    optim::newton_schulz(cpu, optim::newton_schulz_args<T, 3>{{g.data(), {c.M, c.A, c.B}}, {o.data(), {c.M, c.A, c.B}}}, {.heads = c.heads});
  });
}

}  // namespace

int main(int argc, char** argv) {
  using namespace k3::bench;
  csv_init(argc, argv);
  int const reps = argc > 1 ? std::max(1, std::atoi(argv[1])) : 5;
  print_header("muon: NS5 GFLOP/s vs same-run Eigen GEMM rate; P2P plan bytes vs all-gather");
  int const nt = hardware_threads();
  k3::cpu::threads<> cpu(nt);
  gemm_yardstick gemm(nt);
  int const nts = nt;
  std::vector<ns_case> cases = {
      {"1024x4096 stack", nts, 1024, 4096, 1, false},  {"4096x1024 stack", nts, 4096, 1024, 1, false},
      {"1024x7168 stack", nts, 1024, 7168, 1, false},  {"2048x2048 stack", nts, 2048, 2048, 1, false},
      {"1024x4096 bf16 stack", nts, 1024, 4096, 1, true}, {"1024x4096 single", 1, 1024, 4096, 1, false},
      {"2048x4096 single", 1, 2048, 4096, 1, false},   {"per-head 16x128 x 2048", nts, 2048, 2048, 16, false},
  };
  std::printf("%-24s %10s %10s %10s %8s\n", "matrices", "ms", "GFLOP/s", "GEMM", "ratio");
  for (auto const& c : cases) {
    std::mt19937_64 rng(7);
    std::normal_distribution<float> nd;
    std::size_t const n = static_cast<std::size_t>(c.M * c.A * c.B);
    std::vector<float> gf, of;
    std::vector<k3::bfloat16> gb, ob;
    if (c.bf16) {
      gb.resize(n);
      ob.resize(n);
      for (auto& x : gb) x = k3::bfloat16(nd(rng));
    } else {
      gf.resize(n);
      of.resize(n);
      for (auto& x : gf) x = nd(rng);
    }
    double const flops = static_cast<double>(c.M * c.heads) * optim::newton_schulz_flops(c.A / c.heads, c.B, 5);
    std::vector<double> t, y;
    for (int r = 0; r < reps; ++r) {  // interleaved with the yardstick
      y.push_back(gemm.gflops());
      t.push_back(c.bf16 ? run_ns(cpu, gb, ob, c) : run_ns(cpu, gf, of, c));
    }
    double const s = median(t), rate = flops / s * 1e-9, yard = median(y);
    std::printf("%-24s %10.1f %10.1f %10.1f %8.2f\n", c.name, s * 1e3, rate, yard, rate / yard);
    emit({"bench_muon", "newton_schulz", c.bf16 ? "bf16" : "float", "cpu::threads",
          "M=" + std::to_string(c.M) + ";A=" + std::to_string(c.A) + ";B=" + std::to_string(c.B) + ";heads=" + std::to_string(c.heads), 0, s,
          rate, "GFLOP/s", 0, "eigen_gemm", yard, "GFLOP/s", rate / yard, nt});
  }

  // K3's Muon matrices (config: d = 7168, 69 KDA layers with q/k/v/o of 96 heads x 128, per head
  // for q/k/v; 896 experts x 3 matrices of 3584 x 3072 per MoE layer), here 4 KDA and 2 MoE
  // layers with the experts' count scaled down to 64 (the plan's balance is what is measured).
  std::vector<optim::matrix_shape> k3_set;
  for (int l = 0; l < 4; ++l) {
    for (int p = 0; p < 3; ++p) k3_set.push_back({96 * 128, 7168, 96});
    k3_set.push_back({7168, 96 * 128, 1});
  }
  for (int l = 0; l < 2; ++l)
    for (int e = 0; e < 64; ++e) {
      k3_set.push_back({3072, 3584, 1});
      k3_set.push_back({3072, 3584, 1});
      k3_set.push_back({3584, 3072, 1});
    }
  std::printf("\n%-8s %16s %16s %8s %16s\n", "ranks", "max recv MB", "all-gather MB", "ratio", "max/avg recv");
  for (int N : {2, 8, 32}) {
    auto const plan = optim::make_p2p_plan(k3_set, N);
    auto const tr = optim::p2p_traffic_of(plan, k3_set, 2);  // bfloat16 shards
    std::int64_t worst = 0, total = 0;
    for (auto b : tr.recv_bytes) worst = std::max(worst, b), total += b;
    double const avg = double(total) / N;
    std::printf("%-8d %16.1f %16.1f %8.3f %16.3f\n", N, worst / 1e6, tr.all_gather_recv_bytes / 1e6, double(worst) / tr.all_gather_recv_bytes,
                worst / avg);
    emit({"bench_muon", "p2p_plan_recv", "bf16", "plan", "ranks=" + std::to_string(N), 0, 0, double(worst), "B", 0, "all_gather_recv",
          double(tr.all_gather_recv_bytes), "B", double(worst) / tr.all_gather_recv_bytes, N});
  }
  return 0;
}
