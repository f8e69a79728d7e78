// NS5 on a CUDA backend (k3/optim/cuda.cuh) against the float64 formula written out:
// matrices and stacks, tall and wide, per head, Moonlight's factor, float/double/bfloat16
// storage, NaN confined to its block, empty inputs and the shared argument checks. Runs on the
// CPU through the SIMT host runtime in every build, and on a GPU in the nvcc build.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "k3/optim/cuda.cuh"
#include "support/error_of.hpp"
#include "support/newton_schulz_reference.hpp"

namespace optim = k3::optim;
using k3::index_t;

namespace {

template <class T>
std::vector<T> random_stack(std::size_t n, unsigned seed) {
  std::mt19937_64 r(seed);
  std::normal_distribution<double> nd;
  std::vector<T> v(n);
  for (auto& x : v) x = k3::store_as<T>(nd(r));
  return v;
}

template <class T>
std::vector<T> on_device(std::vector<T> const& g, index_t M, index_t A, index_t B, optim::newton_schulz_options const& opt) {
  k3::cuda::stream_backend be;
  std::size_t const n = g.size();
  T* dg = be.allocate<T>(n);
  T* dout = be.allocate<T>(n);
  be.copy(k3::tensor_view<T const, 1>(g.data(), {static_cast<index_t>(n)}), k3::tensor_view<T, 1, k3::cuda_device_space>(dg, {static_cast<index_t>(n)}));
  optim::newton_schulz(be, optim::newton_schulz_args<T, 3, k3::cuda_device_space>{{dg, {M, A, B}}, {dout, {M, A, B}}}, opt);
  std::vector<T> o(n);
  be.copy(k3::tensor_view<T const, 1, k3::cuda_device_space>(dout, {static_cast<index_t>(n)}), k3::tensor_view<T, 1>(o.data(), {static_cast<index_t>(n)}));
  be.fence();
  be.deallocate(dg, n);
  be.deallocate(dout, n);
  return o;
}

// The float64 formula per block of the stack (on the values as stored), times the scale.
template <class T>
std::vector<double> reference(std::vector<T> const& g, index_t M, index_t A, index_t B, optim::newton_schulz_options const& opt) {
  index_t const rows = A / opt.heads;
  double const f = opt.scale == optim::muon_scale::moonlight ? optim::moonlight_factor(A, B) : 1.0;
  std::vector<double> out(g.size());
  for (index_t blk = 0; blk < M * opt.heads; ++blk) {
    std::size_t const at = static_cast<std::size_t>(blk * rows * B);
    std::vector<double> part(static_cast<std::size_t>(rows * B));
    for (std::size_t e = 0; e < part.size(); ++e) part[e] = k3::load_as<double>(g[at + e]);
    auto const o = k3::test::ns5_direct(part, rows, B, opt.steps);
    for (std::size_t e = 0; e < part.size(); ++e) out[at + e] = f * o[e];
  }
  return out;
}

template <class T>
double max_rel(std::vector<T> const& got, std::vector<double> const& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    double const a = k3::load_as<double>(got[i]), b = ref[i];
    if (std::isnan(a) != std::isnan(b)) return std::numeric_limits<double>::infinity();
    if (std::isnan(a)) continue;
    num = std::max(num, std::abs(a - b));
    den = std::max(den, std::abs(b));
  }
  return den > 0 ? num / den : num;
}

}  // namespace

TEST_CASE("CUDA newton_schulz equals the float64 formula: double to 1e-12, float to 1e-4, bfloat16 to 2e-2") {
  struct shape {
    index_t M, A, B, heads;
    int steps;
  };
  for (shape s : {shape{1, 1, 1, 1, 5}, shape{1, 5, 3, 1, 5}, shape{2, 12, 20, 3, 5}, shape{1, 40, 17, 1, 3}, shape{1, 33, 33, 1, 2},
                  shape{3, 8, 37, 2, 5}}) {
    CAPTURE(s.A);
    CAPTURE(s.B);
    CAPTURE(s.heads);
    std::size_t const n = static_cast<std::size_t>(s.M * s.A * s.B);
    for (auto scale : {optim::muon_scale::none, optim::muon_scale::moonlight}) {
      optim::newton_schulz_options opt;
      opt.heads = s.heads;
      opt.steps = s.steps;
      opt.scale = scale;
      auto const gd = random_stack<double>(n, static_cast<unsigned>(s.A * 7 + s.B));
      CHECK(max_rel(on_device(gd, s.M, s.A, s.B, opt), reference(gd, s.M, s.A, s.B, opt)) < 1e-12);
      auto const gf = random_stack<float>(n, static_cast<unsigned>(s.A + s.B));
      CHECK(max_rel(on_device(gf, s.M, s.A, s.B, opt), reference(gf, s.M, s.A, s.B, opt)) < 1e-4);
      auto const gb = random_stack<k3::bfloat16>(n, static_cast<unsigned>(s.A * s.B));
      CHECK(max_rel(on_device(gb, s.M, s.A, s.B, opt), reference(gb, s.M, s.A, s.B, opt)) < 2e-2);
    }
  }
}

TEST_CASE("CUDA newton_schulz: a NaN stays in its head block, empty stacks, checks before any launch") {
  index_t const M = 2, A = 8, B = 10, H = 2;
  auto g = random_stack<float>(static_cast<std::size_t>(M * A * B), 3);
  g[static_cast<std::size_t>(A * B + 5 * B + 1)] = std::numeric_limits<float>::quiet_NaN();  // matrix 1, head 1
  auto const dev = on_device(g, M, A, B, {.heads = H});
  CHECK(max_rel(dev, reference(g, M, A, B, {.heads = H})) < 1e-4);
  for (index_t e = 0; e < M * A * B; ++e) CHECK(std::isnan(dev[static_cast<std::size_t>(e)]) == (e >= A * B + (A / H) * B));
  CHECK(on_device(std::vector<float>{}, 0, A, B, {}).empty());
  k3::cuda::stream_backend be;
  k3::tensor_view<float, 2, k3::cuda_device_space> d(reinterpret_cast<float*>(256), {6, 8}), e(reinterpret_cast<float*>(4096), {6, 8});
  CHECK(k3::test::error_of([&] { optim::newton_schulz(be, optim::newton_schulz_args<float, 2, k3::cuda_device_space>{d, e}, {.heads = 4}); })
            .find("option 'heads': 4 heads do not divide the A = 6 rows") != std::string::npos);
  CHECK(k3::test::names_overlap(
      k3::test::error_of([&] { optim::newton_schulz(be, optim::newton_schulz_args<float, 2, k3::cuda_device_space>{d, {d.data_handle() + 1, {6, 8}}}); }),
      "o", "g"));
}
