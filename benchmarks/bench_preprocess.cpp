// KDA pre-processing against memory speed: each op's bytes read and written at the API (x and
// y for a forward; x, the output gradient and dx for a backward; parameters are negligible)
// per second, over a same-run in-place read-then-write pass of 256 MiB on the same threads,
// medians of runs interleaved with the pass. Bar: every op >= 0.5 x the pass.
//
//   bench_preprocess [T]        (default T = 16384: every tensor far beyond the last-level cache)
//
// Shape: B = 1, H = 16, K = 128 (C = H K = 2048 channels for the conv, width 4), float32, the
// K3 gate (lower bound -5), on cpu::simd (one thread) and cpu::threads (all hardware threads).
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common/bench.hpp"
#include "k3/backend/cpu/simd.hpp"
#include "k3/kda/preprocess.hpp"

namespace {

using k3::host_view;
using k3::index_t;
using namespace k3::bench;

template <class Backend>
void run(Backend const& be, char const* backend_name, int threads, index_t T, int reps) {
  index_t const B = 1, H = 16, K = 128, C = H * K, W = 4;
  std::size_t const n = static_cast<std::size_t>(B * T * C);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  auto fill = [&](aligned_buffer<float>& v, std::size_t m, float s) {
    v.resize(m);
    for (auto& e : v) e = s * nd(rng);
  };
  aligned_buffer<float> x, dy, y, dx, w, bias, dw, db, A_log, dt_bias, dA, ddt;
  fill(x, n, 1.0f);
  fill(dy, n, 1.0f);
  fill(w, static_cast<std::size_t>(C * W), 0.5f);
  fill(bias, static_cast<std::size_t>(C), 0.1f);
  fill(A_log, static_cast<std::size_t>(H), 0.5f);
  fill(dt_bias, static_cast<std::size_t>(H * K), 0.5f);
  y.assign(n, 0.0f);
  dx.assign(n, 0.0f);
  dw.assign(w.size(), 0.0f);
  db.assign(bias.size(), 0.0f);
  dA.assign(A_log.size(), 0.0f);
  ddt.assign(dt_bias.size(), 0.0f);
  auto x3 = host_view(x.data(), B, T, C);
  auto x4 = host_view(x.data(), B, T, H, K);
  auto dy3 = host_view(dy.data(), B, T, C);
  auto dy4 = host_view(dy.data(), B, T, H, K);
  auto y3 = host_view(y.data(), B, T, C);
  auto y4 = host_view(y.data(), B, T, H, K);
  auto dx3 = host_view(dx.data(), B, T, C);
  auto dx4 = host_view(dx.data(), B, T, H, K);
  auto wv = host_view(w.data(), C, W);
  auto bv = host_view(bias.data(), C);
  auto Av = host_view(A_log.data(), H);
  auto dtv = host_view(dt_bias.data(), H, K);
  double const lb = -5.0;

  struct op {
    char const* name;
    double bytes;
    std::function<void()> f;
  };
  double const nb = double(n) * sizeof(float);
  std::vector<op> ops = {
      {"short_conv", 2 * nb, [&] { k3::kda::short_conv(be, k3::kda::short_conv_args<float>{.x = x3, .weight = wv, .bias = bv, .y = y3}); }},
      {"short_conv_backward", 3 * nb,
       [&] {
         k3::kda::short_conv_backward(be, k3::kda::short_conv_backward_args<float>{.x = x3, .weight = wv, .bias = bv, .d_y = dy3, .d_x = dx3,
                                                                                   .d_weight = host_view(dw.data(), C, W), .d_bias = host_view(db.data(), C)});
       }},
      {"l2norm", 2 * nb, [&] { k3::kda::l2norm(be, k3::kda::l2norm_args<float>{.x = x4, .y = y4}); }},
      {"l2norm_backward", 3 * nb, [&] { k3::kda::l2norm_backward(be, k3::kda::l2norm_backward_args<float>{.x = x4, .d_y = dy4, .d_x = dx4}); }},
      {"gate_lower_bound", 2 * nb,
       [&] { k3::kda::gate_lower_bound(be, k3::kda::gate_args<float>{.x = x4, .A_log = Av, .dt_bias = dtv, .g = y4}, {.lower_bound = lb}); }},
      {"gate_lower_bound_backward", 3 * nb,
       [&] {
         k3::kda::gate_lower_bound_backward(be,
                                            k3::kda::gate_backward_args<float>{.x = x4, .A_log = Av, .dt_bias = dtv, .d_g = dy4, .d_x = dx4,
                                                                               .d_A_log = host_view(dA.data(), H), .d_dt_bias = host_view(ddt.data(), H, K)},
                                            {.lower_bound = lb});
       }},
  };
  inplace_pass_yardstick pass(threads);
  std::vector<std::vector<double>> t(ops.size());
  std::vector<double> p;
  for (auto& o : ops) o.f();  // first touch and warm-up
  for (int r = 0; r < reps; ++r) {
    p.push_back(pass.gbps());
    for (std::size_t i = 0; i < ops.size(); ++i) t[i].push_back(seconds(ops[i].f));
  }
  double const pm = median(p);
  std::printf("\n%s (%d thread%s): in-place pass %.2f GB/s (median of %d)\n", backend_name, threads, threads == 1 ? "" : "s", pm, reps);
  std::printf("%-27s %9s %9s %7s  %s\n", "op", "ms", "GB/s", "x pass", "bar >= 0.5");
  std::string const shape = "B=1;T=" + std::to_string(T) + ";H=16;K=128;W=4";
  for (std::size_t i = 0; i < ops.size(); ++i) {
    double const s = median(t[i]), gbps = ops[i].bytes / s * 1e-9;
    std::printf("%-27s %9.2f %9.2f %7.2f  %s\n", ops[i].name, s * 1e3, gbps, gbps / pm, gbps / pm >= 0.5 ? "pass" : "FAIL");
    emit({"kda_preprocess", ops[i].name, "float32", backend_name, shape, static_cast<long long>(T), s, gbps, "GB/s", double(T) / s,
          "inplace_pass_256MiB", pm, "GB/s", gbps / pm, threads});
  }
}

}  // namespace

int main(int argc, char** argv) {
  csv_init(argc, argv);
  index_t const T = argc > 1 ? std::atoll(argv[1]) : 16384;
  int const reps = 7;
  print_header("KDA pre-processing (B=1, H=16, K=128, conv width 4, float32, gate bound -5) against an in-place pass");
  run(k3::cpu::simd<>{}, "simd", 1, T, reps);
  run(k3::cpu::threads<>{}, "threads", hardware_threads(), T, reps);
  return 0;
}
