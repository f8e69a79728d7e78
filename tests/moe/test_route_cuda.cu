// GPU router + histogram vs the CPU reference (bit-exact). Exits 77 without a GPU.
#include <doctest/doctest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "support/error_of.hpp"
#include "k3/backend/cpu/serial.hpp"
#include "k3/moe/cuda.cuh"
#include "k3/moe/quantile_balancing.hpp"
#include "k3/moe/router.hpp"

namespace moe = k3::moe;
using k3::index_t;

namespace {

template <class T>
T* to_device(std::vector<T> const& v) {
  T* p = nullptr;
  K3_CUDA_CHECK(cudaMalloc(&p, sizeof(T) * (v.empty() ? 1 : v.size())));
  if (!v.empty()) K3_CUDA_CHECK(cudaMemcpy(p, v.data(), sizeof(T) * v.size(), cudaMemcpyHostToDevice));
  return p;
}
template <class T>
std::vector<T> to_host(T const* p, std::size_t n) {
  std::vector<T> v(n);
  K3_CUDA_CHECK(cudaMemcpy(v.data(), p, sizeof(T) * n, cudaMemcpyDeviceToHost));
  return v;
}

void run_case(index_t m, index_t n, index_t k, index_t bins, bool ties, std::uint64_t seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> nd;
  std::vector<float> s(static_cast<std::size_t>(m * n)), b(static_cast<std::size_t>(n));
  for (auto& x : b) x = 0.1f * nd(g);
  for (auto& x : s) {
    x = 1.f / (1.f + std::exp(-nd(g)));
    if (ties) x = std::round(x * 16.f) / 16.f;
  }
  if (ties)  // on a 1/16 grid too, so that score + bias ties exactly and the lower index must win
    for (auto& x : b) x = std::round(x * 16.f) / 16.f;
  std::vector<std::uint8_t> mask(static_cast<std::size_t>(m), 1);
  for (index_t i = 1; i < m; i += 5) mask[i] = 0;
  // CPU reference
  moe::router_options opt;
  opt.k = k;
  opt.routed_scale = 2.5f;
  std::vector<std::int32_t> idx(static_cast<std::size_t>(m * k));
  std::vector<float> w(idx.size()), cut(static_cast<std::size_t>(m));
  std::vector<std::int64_t> load(static_cast<std::size_t>(n));
  k3::const_view<float, 2> sv(s.data(), {m, n});
  k3::const_view<float, 1> bv(b.data(), {n});
  k3::const_view<std::uint8_t, 1> mv(mask.data(), {m});
  // The serial kernel itself: k3/moe.hpp (and so moe::route) holds the host SIMD path, which nvcc does not compile.
  moe::detail::route_serial(sv, bv,
                            {k3::host_view(idx.data(), m, k), k3::host_view(w.data(), m, k), k3::host_view(cut.data(), m),
                             k3::host_view(load.data(), n)},
                            opt, mv);
  auto hist = moe::qb_histogram::for_bias(bv, bins);
  moe::qb_accumulate(k3::cpu::serial{}, moe::qb_accumulate_args<float>{.scores = sv, .cutoff = k3::const_view<float, 1>(cut.data(), {m}), .mask = mv, .histogram = &hist}, opt);
  // GPU
  moe::cuda::route_args a;
  a.scores = to_device(s);
  a.bias = to_device(b);
  a.mask = to_device(mask);
  a.m = m;
  a.n = n;
  a.k = k;
  a.routed_scale = 2.5f;
  a.indices = to_device(std::vector<std::int32_t>(idx.size()));
  a.weights = to_device(std::vector<float>(w.size()));
  a.cutoff = to_device(std::vector<float>(cut.size()));
  a.load = to_device(std::vector<unsigned long long>(static_cast<std::size_t>(n), 0));
  a.hist = to_device(std::vector<unsigned long long>(static_cast<std::size_t>(n * bins), 0));
  a.hist_lo = hist.lo();
  a.hist_inv_width = hist.inv_width();
  a.bins = static_cast<std::int32_t>(bins);
  moe::cuda::route_launch(a, nullptr);
  K3_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(to_host(a.indices, idx.size()) == idx);
  auto gw = to_host(a.weights, w.size());
  CHECK(std::memcmp(gw.data(), w.data(), w.size() * sizeof(float)) == 0);
  auto gc = to_host(a.cutoff, cut.size());
  for (index_t i = 0; i < m; ++i)
    if (mask[i]) CHECK(gc[i] == cut[i]);
  auto gl = to_host(a.load, static_cast<std::size_t>(n));
  for (index_t j = 0; j < n; ++j) CHECK(static_cast<std::int64_t>(gl[j]) == load[j]);
  auto gh = to_host(a.hist, static_cast<std::size_t>(n * bins));
  bool same = true;
  for (index_t x = 0; x < n * bins; ++x) same &= static_cast<std::int64_t>(gh[x]) == hist.data()[x];
  CHECK(same);
  for (void const* p : {static_cast<void const*>(a.scores), static_cast<void const*>(a.bias), static_cast<void const*>(a.mask),
                        static_cast<void const*>(a.indices), static_cast<void const*>(a.weights), static_cast<void const*>(a.cutoff),
                        static_cast<void const*>(a.load), static_cast<void const*>(a.hist)})
    cudaFree(const_cast<void*>(p));
}

}  // namespace

TEST_CASE("CUDA router + histogram are bit-identical to the CPU reference") {
  run_case(1, 2, 1, 7, false, 1);
  run_case(333, 37, 5, 97, true, 2);
#if defined(K3_SIMT_TSAN)
  // Under ThreadSanitizer (30x slower) fewer tokens: every block runs the same code, and the
  // races it looks for are within a block.
  run_case(96, 896, 16, 1000, false, 3);
#else
  run_case(2048, 896, 16, 1000, false, 3);
#endif
  run_case(100, 64, 63, 16, true, 4);
}

TEST_CASE("CUDA router rejects bad arguments") {
  moe::cuda::route_args a;
  a.m = 0;
  CHECK_THROWS_AS(moe::cuda::route_launch(a, nullptr), k3::error);
}

TEST_CASE("CUDA router rejects outputs over its inputs or each other, naming both (host-side check, before any launch)") {
  // The check reads only the pointers: host memory stands in for device memory here.
  std::vector<float> f(4096);
  std::vector<std::int32_t> idx(64);
  moe::cuda::route_args a;
  a.m = 8;
  a.n = 16;
  a.k = 2;
  a.scores = f.data();
  a.bias = f.data() + 1024;
  a.indices = idx.data();
  a.weights = f.data() + 2048;
  a.cutoff = f.data() + 3072;
  auto err = [&](moe::cuda::route_args const& b) {
    try {
      moe::cuda::route_launch(b, nullptr);
    } catch (k3::error const& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  auto const names = k3::test::names_overlap;
  auto b = a;
  b.weights = f.data() + 5;
  CHECK(names(err(b), "weights", "scores"));
  b = a;
  b.cutoff = f.data() + 2048 + 3;
  CHECK(names(err(b), "weights", "cutoff"));
  b = a;
  b.hist = reinterpret_cast<unsigned long long*>(f.data() + 1024);
  b.bins = 4;
  b.hist_inv_width = 1.f;
  CHECK(names(err(b), "hist", "bias"));
}
