// k3::moe::grouped_ffn_forward / grouped_ffn_backward on a CUDA backend (k3/moe/grouped_ffn.cuh)
// against the float64 slot-by-slot reference: double to 1e-12, float 2e-5 / 1e-4, bfloat16 at
// fla's tolerances; T = 1, T = 0, k = n, k = 1, experts without slots, more than one 16-row tile
// per expert, id -1 and weight-0 slots; NaN confined to its token; bad ids and shapes get the
// host backend's errors. Runs on the CPU through the SIMT host runtime in every build, and on a
// GPU in the nvcc build.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "k3/moe/grouped_ffn.cuh"
#include "support/error_of.hpp"
#include "support/grouped_ffn_reference.hpp"
#include "support/metrics.hpp"

namespace moe = k3::moe;
using k3::index_t;
using vec = std::vector<double>;
using k3::test::check_against;
using k3::test::grouped_ffn_problem;
using k3::test::grouped_ffn_result;
using k3::test::rounded;
using k3::test::stored;
using k3::test::widened;

namespace {

// A host vector's copy in device memory, freed with the object.
template <class T>
class device_vector {
 public:
  device_vector(k3::cuda::stream_backend const& b, std::vector<T> const& h) : b_(b), n_(h.size()), p_(b.allocate<T>(n_ ? n_ : 1)) {
    if (n_) b.copy(k3::tensor_view<T const, 1>(h.data(), {static_cast<index_t>(n_)}), k3::tensor_view<T, 1, k3::cuda_device_space>(p_, {static_cast<index_t>(n_)}));
  }
  device_vector(device_vector const&) = delete;
  device_vector& operator=(device_vector const&) = delete;
  ~device_vector() { b_.deallocate(p_, n_ ? n_ : 1); }
  T* get() const { return p_; }
  std::vector<T> host() const {
    std::vector<T> h(n_);
    if (n_) b_.copy(k3::tensor_view<T const, 1, k3::cuda_device_space>(p_, {static_cast<index_t>(n_)}), k3::tensor_view<T, 1>(h.data(), {static_cast<index_t>(n_)}));
    b_.fence();
    return h;
  }

 private:
  k3::cuda::stream_backend const& b_;
  std::size_t n_;
  T* p_;
};

template <class T, std::size_t R>
k3::tensor_view<T, R, k3::cuda_device_space> dev(device_vector<std::remove_const_t<T>> const& v, typename k3::tensor_view<T, R, k3::cuda_device_space>::extents_type const& ext) {
  return {v.get(), ext};
}

template <class T>
grouped_ffn_result run(grouped_ffn_problem const& q) {
  using C = k3::accumulation_t<T>;
  k3::cuda::stream_backend b;
  device_vector<T> z(b, stored<T>(q.z)), p(b, stored<T>(q.p)), wg(b, stored<T>(q.w_gate)), wu(b, stored<T>(q.w_up)), wd(b, stored<T>(q.w_down)),
      du(b, stored<T>(q.du));
  device_vector<std::int64_t> idx(b, q.idx);
  std::size_t const tl = static_cast<std::size_t>(q.T * q.l);
  device_vector<T> u(b, std::vector<T>(tl)), dz(b, std::vector<T>(tl)), dp(b, std::vector<T>(q.p.size())), dwg(b, std::vector<T>(q.w_gate.size())),
      dwu(b, std::vector<T>(q.w_up.size())), dwd(b, std::vector<T>(q.w_down.size()));
  std::vector<C> const sevens(static_cast<std::size_t>(q.T * q.k * q.f), C(7));  // every element must be written
  device_vector<C> hg(b, sevens), hu(b, sevens);
  moe::grouped_ffn_args<T, k3::cuda_device_space> a{dev<T const, 2>(z, {q.T, q.l}),       dev<std::int64_t const, 2>(idx, {q.T, q.k}),
                                                    dev<T const, 2>(p, {q.T, q.k}),       dev<T const, 3>(wg, {q.n, q.f, q.l}),
                                                    dev<T const, 3>(wu, {q.n, q.f, q.l}), dev<T const, 3>(wd, {q.n, q.l, q.f}),
                                                    dev<T, 2>(u, {q.T, q.l}),             dev<C, 3>(hg, {q.T, q.k, q.f}),
                                                    dev<C, 3>(hu, {q.T, q.k, q.f})};
  moe::grouped_ffn_options const o{q.beta_gate, q.beta_up};
  moe::grouped_ffn_forward(b, a, o);
  moe::grouped_ffn_backward(b, moe::grouped_ffn_backward_args<T, k3::cuda_device_space>{a,
                            moe::grouped_ffn_gradients<T, k3::cuda_device_space>{dev<T const, 2>(du, {q.T, q.l}), dev<T, 2>(dz, {q.T, q.l}),
                                                                                 dev<T, 2>(dp, {q.T, q.k}), dev<T, 3>(dwg, {q.n, q.f, q.l}),
                                                                                 dev<T, 3>(dwu, {q.n, q.f, q.l}), dev<T, 3>(dwd, {q.n, q.l, q.f})}},
                            o);
  return {widened(u.host()), widened(hg.host()), widened(hu.host()), widened(dz.host()),
          widened(dp.host()), widened(dwg.host()), widened(dwu.host()), widened(dwd.host())};
}

auto const rel_max = [](vec const& g, vec const& r) { return k3::test::rel_max(g, r); };
auto const rel_rms = [](vec const& g, vec const& r) { return k3::test::rel_rms(g, r); };

struct shape {
  index_t T, k, n, l, f, used, hole, zero;
};

}  // namespace

TEST_CASE("CUDA grouped_ffn equals the float64 reference: double to 1e-12, float 2e-5 / 1e-4, bfloat16 at fla's tolerances") {
  shape const shapes[] = {
      {9, 3, 5, 7, 6, -1, 0, 0},     // odd everything
      {1, 2, 4, 5, 3, -1, 0, 0},     // T = 1
      {6, 4, 4, 3, 5, -1, 0, 0},     // k = n
      {7, 1, 3, 4, 4, -1, 0, 0},     // k = 1
      {11, 2, 8, 6, 7, 3, 5, 4},     // experts without slots, id -1 slots, weight-0 slots
      {0, 3, 4, 5, 6, -1, 0, 0},     // an empty batch
      {37, 2, 3, 18, 20, 2, 0, 0},   // 37 slots per expert: three 16-row tiles, two panels deep
  };
  unsigned seed = 1;
  for (shape s : shapes) {
    CAPTURE(s.T);
    CAPTURE(s.k);
    CAPTURE(s.n);
    auto const q = k3::test::random_grouped_ffn(s.T, s.k, s.n, s.l, s.f, seed++, s.used, s.hole, s.zero);
    check_against(run<double>(q), k3::test::grouped_ffn_reference(q), rel_max, 1e-12, 1e-12);
    auto const qf = rounded<float>(q);
    check_against(run<float>(qf), k3::test::grouped_ffn_reference(qf), rel_max, 2e-5, 1e-4);
    auto const qb = rounded<k3::bfloat16>(q);
    check_against(run<k3::bfloat16>(qb), k3::test::grouped_ffn_reference(qb), rel_rms, 5e-3, 8e-3);
  }
}

TEST_CASE("CUDA grouped_ffn: slot rules, a NaN in one token stays in that token and its experts") {
  auto const q = k3::test::random_grouped_ffn(13, 3, 6, 9, 8, 5, 4, 4, 3);
  auto const r = run<float>(q);
  for (std::size_t s = 0; s < q.idx.size(); ++s) {
    if (q.idx[s] < 0)
      CHECK(r.dp[s] == 0.0);
    else if (q.p[s] == 0.0)
      CHECK(r.dp[s] != 0.0);
  }
  for (index_t e = 4; e < q.n; ++e)
    for (index_t i = 0; i < q.f * q.l; ++i) CHECK(r.dw_up[static_cast<std::size_t>(e * q.f * q.l + i)] == 0.0);

  auto qn = k3::test::random_grouped_ffn(8, 2, 6, 5, 4, 9);
  index_t const bad = 3;
  qn.z[static_cast<std::size_t>(bad * qn.l + 2)] = std::numeric_limits<double>::quiet_NaN();
  auto const n = run<float>(qn);
  k3::test::check_nan_confined(qn, bad, n);
}

TEST_CASE("CUDA grouped_ffn: bad ids and shapes get the host backend's errors") {
  auto q = k3::test::random_grouped_ffn(4, 2, 3, 5, 4, 2);
  q.idx[5] = 3;
  std::string const e = k3::test::error_of([&] { run<float>(q); });
  CHECK(e.find("argument 'indices': expected expert ids in [-1, 3), got 3 at [2, 1]") != std::string::npos);
  q.idx[5] = -7;
  CHECK(k3::test::error_of([&] { run<float>(q); }).find("got -7 at [2, 1]") != std::string::npos);
  k3::cuda::stream_backend b;
  auto* p = reinterpret_cast<float*>(4096);
  auto* ip = reinterpret_cast<std::int64_t*>(1 << 20);
  using dv2 = k3::tensor_view<float const, 2, k3::cuda_device_space>;
  using dv3 = k3::tensor_view<float const, 3, k3::cuda_device_space>;
  moe::grouped_ffn_args<float, k3::cuda_device_space> a{dv2(p, {4, 5}),    {ip, {4, 2}},    dv2(p, {4, 2}), dv3(p, {3, 4, 5}),
                                                        dv3(p, {3, 4, 5}), dv3(p, {3, 4, 5}), {p, {4, 5}}};
  CHECK(k3::test::error_of([&] { moe::grouped_ffn_forward(b, a); }).find("argument 'w_down': expected shape [3, 5, 4]") != std::string::npos);
}
