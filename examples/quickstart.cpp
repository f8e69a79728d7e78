// Quickstart: a K3-shaped KDA layer core on built-in defaults (B=1, T=2048, H=16 heads,
// K=V=128, float32): the chunked forward, checked against the serial recurrence (relative
// RMS), and its throughput. Pre-processing (L2 norm, gates, short conv) is applied by the
// caller; here q, k are unit-norm, g is a lower-bounded gate in (-5, 0) and beta in (0, 1).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "k3/kda.hpp"
#include "k3/version.hpp"

int main() {
  using k3::index_t;
  index_t const B = 1, T = 2048, H = 16, K = 128, V = 128;
  std::printf("k3 %s quickstart (simd isa: %s)\n", k3::version_string, k3::simd::isa_name<xsimd::default_arch>());
  std::printf("KDA layer core: B=%lld T=%lld H=%lld K=V=%lld, float32\n", (long long)B, (long long)T, (long long)H, (long long)K);

  std::mt19937 rng(0);
  std::normal_distribution<float> nd;
  auto unit_rows = [&](index_t rows, index_t dim) {
    std::vector<float> x(std::size_t(rows * dim));
    for (index_t r = 0; r < rows; ++r) {
      float s = 0;
      for (index_t i = 0; i < dim; ++i) s += (x[std::size_t(r * dim + i)] = nd(rng)) * x[std::size_t(r * dim + i)];
      for (index_t i = 0; i < dim; ++i) x[std::size_t(r * dim + i)] /= std::sqrt(s);
    }
    return x;
  };
  std::vector<float> q = unit_rows(B * T * H, K), k = unit_rows(B * T * H, K);
  std::vector<float> v(std::size_t(B * T * H * V)), g(std::size_t(B * T * H * K)), beta(std::size_t(B * T * H));
  for (auto& x : v) x = nd(rng);
  for (auto& x : g) x = -5.0f / (1.0f + std::exp(-(nd(rng) - 4.0f)));  // lower-bounded gate, mostly close to 0
  for (auto& x : beta) x = 1.0f / (1.0f + std::exp(-nd(rng)));
  std::vector<float> o_chunk(v.size()), o_serial(v.size()), ht_chunk(std::size_t(B * H * K * V)), ht_serial(ht_chunk.size());

  auto args = [&](std::vector<float>& o, std::vector<float>& ht) {
    k3::kda::forward_args<float> a;
    a.q = k3::host_view(q.data(), B, T, H, K);
    a.k = k3::host_view(k.data(), B, T, H, K);
    a.v = k3::host_view(v.data(), B, T, H, V);
    a.g = k3::host_view(g.data(), B, T, H, K);
    a.beta = k3::host_view(beta.data(), B, T, H);
    a.o = k3::host_view(o.data(), B, T, H, V);
    a.ht = k3::host_view(ht.data(), B, H, K, V);
    return a;
  };
  k3::cpu::threads<> backend;  // one thread per hardware thread
  k3::kda::options opt;         // chunked form, scale K^-1/2
  opt.gate_lower_bound = -5.0;  // lets the chunked form use dense diagonal tiles

  auto t0 = std::chrono::steady_clock::now();
  k3::kda::forward(backend, args(o_chunk, ht_chunk), opt);
  auto t1 = std::chrono::steady_clock::now();
  opt.mode = k3::kda::algorithm::recurrent;
  k3::kda::forward(backend, args(o_serial, ht_serial), opt);
  auto t2 = std::chrono::steady_clock::now();

  auto rel_rms = [](std::vector<float> const& ref, std::vector<float> const& x) {
    double num = 0, den = 0;
    for (std::size_t i = 0; i < ref.size(); ++i) {
      num += double(ref[i] - x[i]) * double(ref[i] - x[i]);
      den += double(ref[i]) * double(ref[i]);
    }
    return std::sqrt(num / den);
  };
  double const sc = std::chrono::duration<double>(t1 - t0).count(), ss = std::chrono::duration<double>(t2 - t1).count();
  double const flops = double(H) * (6.0 * T * K * K + 3.0 * T * 64 * K + double(T) * 64 * 64);  // Kimi Linear's count
  std::printf("chunked vs serial: rel RMS o %.2e, final state %.2e\n", rel_rms(o_serial, o_chunk), rel_rms(ht_serial, ht_chunk));
  std::printf("chunked forward: %.1f ms, %.0f tokens/s, %.1f GFLOP/s (%d threads)\n", sc * 1e3, double(B * T) / sc, flops / sc * 1e-9,
              backend.concurrency());
  std::printf("serial  forward: %.1f ms, %.0f tokens/s, %.1f GFLOP/s\n", ss * 1e3, double(B * T) / ss, flops / ss * 1e-9);
  return rel_rms(o_serial, o_chunk) < 1e-4 ? 0 : 1;
}
