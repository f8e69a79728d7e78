// The Stable LatentMoE layer (k3::moe::latent_moe_forward / _backward) at K3's per-layer widths
// (d = 7168, latent l = 3584, expert f = 3072, top-16), with the expert count and the tokens
// scaled to fit 24 GB: 16 experts, so top-16 sends every token to every expert, and T = 128
// tokens, the 128 tokens per expert that K3's 896 experts see in a 7168-token micro-batch
// (7168 · 16 / 896); float32, all threads. GFLOP/s count the layer's GEMM FLOPs (router 2Tnd, down 2Tld, experts
// 6Tkfl forward, up 2Tdl), against the same-run Eigen GEMM rate (gemm_yardstick), medians of
// interleaved runs; then the backward (from the state the forward saved) over the forward, and
// the bytes that state holds against the naive layer's (which also keeps every expert output
// and the dispatched copy of z).
//   usage: bench_latent_moe [tokens (default 128)] [repetitions (default 3)]
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "common/bench.hpp"
#include "k3/backend/cpu/simd.hpp"
#include "k3/moe/latent_moe.hpp"

int main(int argc, char** argv) {
  using namespace k3::bench;
  using k3::index_t;
  csv_init(argc, argv);
  index_t const T = argc > 1 ? std::max(1, std::atoi(argv[1])) : 128;
  int const reps = argc > 2 ? std::max(1, std::atoi(argv[2])) : 3;
  index_t const d = 7168, l = 3584, f = 3072, n = 16, k = 16;
  print_header("latent MoE layer: d=7168 l=3584 f=3072 n=16 top-16, float32");
  int const nt = hardware_threads();
  k3::cpu::threads<> cpu(nt);
  gemm_yardstick gemm(nt);
  std::mt19937_64 rng(3);
  std::normal_distribution<float> nd;
  auto fill = [&](std::size_t m, float sc) {
    aligned_buffer<float> v(m);
    for (auto& x : v) x = sc * nd(rng);
    return v;
  };
  auto x = fill(static_cast<std::size_t>(T * d), 1.f), wr = fill(static_cast<std::size_t>(n * d), 0.01f), wd = fill(static_cast<std::size_t>(l * d), 0.01f);
  auto wg = fill(static_cast<std::size_t>(n * f * l), 0.02f), wu = fill(wg.size(), 0.02f), wdn = fill(wg.size(), 0.02f);
  auto wup = fill(static_cast<std::size_t>(d * l), 0.02f), dy = fill(x.size(), 1.f);
  aligned_buffer<float> y(x.size()), p(static_cast<std::size_t>(T * k));
  std::vector<std::int64_t> idx(p.size());
  k3::moe::latent_moe_args<float> a{{x.data(), {T, d}},          {wr.data(), {n, d}},       {},  {wd.data(), {l, d}},
                                    {wg.data(), {n, f, l}},      {wu.data(), {n, f, l}},    {wdn.data(), {n, l, f}},
                                    {},                          {wup.data(), {d, l}}};
  a.y = {y.data(), {T, d}};
  a.indices = {idx.data(), {T, k}};
  a.weights = {p.data(), {T, k}};
  aligned_buffer<float> dx(x.size()), dwr(wr.size()), dwd(wd.size()), dwg(wg.size()), dwu(wu.size()), dwdn(wdn.size()), dwup(wup.size());
  std::vector<float> dnw(static_cast<std::size_t>(l));
  k3::moe::latent_moe_gradients<float> g{{dy.data(), {T, d}},      {dx.data(), {T, d}},       {dwr.data(), {n, d}},   {dwd.data(), {l, d}},
                                         {dwg.data(), {n, f, l}}, {dwu.data(), {n, f, l}},   {dwdn.data(), {n, l, f}}, {dnw.data(), {l}},
                                         {dwup.data(), {d, l}}};
  k3::moe::latent_moe_options o;
  o.k = k;
  k3::moe::latent_moe_saved<float> saved;
  a.saved = &saved;
  double const fwd_flops = 2.0 * T * n * d + 2.0 * T * l * d + 6.0 * T * k * f * l + 2.0 * T * d * l;
  std::vector<double> tf, tb, ys;
  for (int r = 0; r < reps; ++r) {
    ys.push_back(gemm.gflops());
    tf.push_back(seconds([&] { k3::moe::latent_moe_forward(cpu, a, o); }));
    tb.push_back(seconds([&] { k3::moe::latent_moe_backward(cpu, k3::moe::latent_moe_backward_args<float>{a, g}, o); }));
  }
  double const f_s = median(tf), b_s = median(tb), yard = median(ys), rate = fwd_flops / f_s * 1e-9;
  std::printf("%-34s %10s %12s %12s %8s\n", "figure", "ms", "GFLOP/s", "GEMM GFLOP/s", "ratio");
  std::printf("%-34s %10.1f %12.1f %12.1f %8.2f\n", "forward", f_s * 1e3, rate, yard, rate / yard);
  std::printf("%-34s %10.1f %12s %12s %8.2f\n", "backward (from saved) / forward", b_s * 1e3, "", "", b_s / f_s);
  std::printf("%-34s %10.1f MB  naive layer %.1f MB  (%.1f values per token fewer)\n", "saved for backward", saved.bytes() / 1e6,
              saved.naive_bytes() / 1e6, double(saved.naive_bytes() - saved.bytes()) / sizeof(float) / double(T));
  emit({"bench_latent_moe", "latent_moe_forward", "float", "cpu::threads", "T=" + std::to_string(T) + ";d=7168;l=3584;f=3072;n=16;k=16", T, f_s,
        rate, "GFLOP/s", double(T) / f_s, "eigen_gemm", yard, "GFLOP/s", rate / yard, nt});
  emit({"bench_latent_moe", "latent_moe_backward", "float", "cpu::threads", "T=" + std::to_string(T) + ";d=7168;l=3584;f=3072;n=16;k=16", T, b_s,
        0, "s", double(T) / b_s, "latent_moe_forward", f_s, "s", b_s / f_s, nt});
  return 0;
}
