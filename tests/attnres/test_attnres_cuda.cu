// AttnRes CUDA kernels against the CPU backend (float storage; bfloat16 for phase 2). Skipped
// (exit 77) without a GPU.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "support/error_of.hpp"
#include "attnres/cuda_ref.hpp"
#include "k3/attnres/cuda.cuh"

// What a program does once so that its .cpp files can call the launchers of cuda.hpp.
K3_ATTNRES_CUDA_INSTANTIATE(float)
K3_ATTNRES_CUDA_INSTANTIATE(k3::bfloat16)

namespace ka = k3::cuda::attnres;
using i64 = std::int64_t;

namespace {

template <class T>
struct dev {
  T* p = nullptr;
  std::size_t n = 0;
  explicit dev(std::size_t n_) : n(n_) { K3_CUDA_CHECK(cudaMalloc(&p, std::max<std::size_t>(n, 1) * sizeof(T))); }
  dev(std::vector<T> const& h) : dev(h.size()) { K3_CUDA_CHECK(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice)); }
  ~dev() { cudaFree(p); }
  std::vector<T> get() const {
    std::vector<T> h(n);
    K3_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
};

std::vector<float> randn(std::size_t n, std::uint64_t seed, float scale = 1.f) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> nd(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(g);
  return v;
}

template <class A, class B>
double rel(A const& x, B const& y) {
  // A NaN where the other side has none is an infinite error (std::max would drop it).
  double num = 0, den = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    double const a = double(float(x[i])), b = double(float(y[i]));
    if (std::isnan(a) && std::isnan(b)) continue;
    double const e = std::abs(a - b);
    if (!(e <= num)) num = std::isnan(e) ? INFINITY : e;
    den = std::max(den, std::abs(b));
  }
  return den == 0 ? num : num / den;
}

}  // namespace

TEST_CASE("mix forward and backward on the GPU match the CPU backend") {
  for (auto shape : {std::tuple<i64, i64, i64>{1, 3, 5}, {8, 17, 257}, {20, 5, 7168}}) {
    auto const [n, T, d] = shape;
    i64 const n_ = n, d_ = d;  // (doctest's CAPTURE is a lambda: no structured bindings in it)
    CAPTURE(n_);
    CAPTURE(d_);
    auto bank = randn(static_cast<std::size_t>(n * T * d), 1), part = randn(static_cast<std::size_t>(T * d), 2, 2.f), w = randn(static_cast<std::size_t>(d), 3, 2.f / std::sqrt(static_cast<float>(d))),
         g = randn(static_cast<std::size_t>(d), 4, 0.2f), dh = randn(static_cast<std::size_t>(T * d), 5);
    for (auto& x : g) x += 1;
    std::vector<float> h(static_cast<std::size_t>(T * d)), db(bank.size()), dp(part.size()), dw(static_cast<std::size_t>(d)), dg(static_cast<std::size_t>(d)), u(static_cast<std::size_t>(d));
    attnres_cuda_ref::mix_forward(bank.data(), n, part.data(), T, d, w.data(), g.data(), 1e-5f, h.data());
    attnres_cuda_ref::mix_backward(bank.data(), n, part.data(), T, d, w.data(), g.data(), 1e-5f, dh.data(), db.data(), dp.data(), dw.data(),
                                   dg.data());
    for (i64 k = 0; k < d; ++k) u[k] = w[k] * g[k];
    dev<float> Bk(bank), Pt(part), W(w), G(g), U(u), DH(dh), H(h.size()), DB(db.size()), DP(dp.size()), DW(dw.size()), DG(dg.size()), WS(dw.size());
    ka::mix_forward(Bk.p, n, Pt.p, T, d, U.p, 1e-5f, H.p, nullptr);
    ka::mix_backward(Bk.p, n, Pt.p, T, d, W.p, G.p, 1e-5f, DH.p, DB.p, DP.p, DW.p, DG.p, WS.p, nullptr);
    K3_CUDA_CHECK(cudaDeviceSynchronize());
    CHECK(rel(H.get(), h) <= 2e-5);
    CHECK(rel(DB.get(), db) <= 2e-5);
    CHECK(rel(DP.get(), dp) <= 2e-5);
    CHECK(rel(DW.get(), dw) <= 1e-4);
    CHECK(rel(DG.get(), dg) <= 1e-4);
  }
}

TEST_CASE("phase 1 and the fused phase 2 on the GPU match the CPU backend") {
  i64 const n = 8, nq = 24, T = 33, d = 7168;
  auto bank = randn(static_cast<std::size_t>(n * T * d), 11), u = randn(static_cast<std::size_t>(nq * d), 12, 0.05f), pre = randn(static_cast<std::size_t>(T * d), 13, 2.f),
       delta = randn(static_cast<std::size_t>(T * d), 14);
  std::vector<float> rinv(static_cast<std::size_t>(n * T)), o(static_cast<std::size_t>(nq * T * d)), lse(static_cast<std::size_t>(nq * T)), h(static_cast<std::size_t>(T * d)), pre_c = pre;
  attnres_cuda_ref::phase1(bank.data(), n, T, d, u.data(), nq, 1e-5f, rinv.data(), o.data(), lse.data());
  attnres_cuda_ref::phase2_add(o.data() + 5 * T * d, lse.data() + 5 * T, pre_c.data(), delta.data(), u.data() + 5 * d, T, d, 1e-5f, h.data());
  dev<float> Bk(bank), U(u), R(rinv.size()), O(o.size()), L(lse.size()), P(pre), D(delta), H(h.size());
  for (i64 j = 0; j < n; ++j) ka::block_rinv(Bk.p + j * T * d, T, d, 1e-5f, R.p + j * T, nullptr);
  ka::phase1(Bk.p, R.p, n, T, d, U.p, nq, O.p, L.p, nullptr);
  ka::phase2_add(O.p + 5 * T * d, L.p + 5 * T, P.p, D.p, U.p + 5 * d, T, d, 1e-5f, H.p, nullptr);
  K3_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(rel(R.get(), rinv) <= 1e-5);
  CHECK(rel(O.get(), o) <= 2e-5);
  CHECK(rel(L.get(), lse) <= 2e-5);
  CHECK(rel(P.get(), pre_c) == 0);
  CHECK(rel(H.get(), h) <= 2e-5);
  // bfloat16 storage: the same merge from rounded inputs, within bfloat16 rounding
  std::vector<k3::bfloat16> ob(static_cast<std::size_t>(T * d)), pb(pre.size()), dbf(delta.size());
  for (std::size_t i = 0; i < ob.size(); ++i) ob[i] = k3::bfloat16(o[5 * T * d + i]);
  for (std::size_t i = 0; i < pb.size(); ++i) {
    pb[i] = k3::bfloat16(pre[i]);
    dbf[i] = k3::bfloat16(delta[i]);
  }
  dev<k3::bfloat16> OB(ob), PB(pb), DBF(dbf), HB(ob.size());
  ka::phase2_add(OB.p, L.p + 5 * T, PB.p, DBF.p, U.p + 5 * d, T, d, 1e-5f, HB.p, nullptr);
  K3_CUDA_CHECK(cudaDeviceSynchronize());
  CHECK(rel(HB.get(), h) <= 2e-2);
}

TEST_CASE("too many sources is a k3::error before any launch") {
  CHECK_THROWS_AS(ka::mix_forward<float>(nullptr, ka::max_sources + 1, nullptr, 1, 4, nullptr, 1e-5f, nullptr, nullptr), k3::error);
}

TEST_CASE("outputs over inputs or each other are a k3::error naming both, before any launch") {
  // The checks read only the pointers: host memory stands in for device memory here.
  i64 const n = 2, T = 3, d = 4, nq = 2;
  std::vector<float> m(1024);
  auto at = [&](int i) { return m.data() + 64 * i; };
  auto err = [](auto&& fn) { return k3::test::error_of(fn); };
  auto const names = k3::test::names_overlap;
  CHECK(names(err([&] { ka::mix_forward<float>(at(0), n, at(1), T, d, at(2), 1e-5f, at(0) + 5, nullptr); }), "h", "bank"));
  CHECK(names(err([&] { ka::mix_forward<float>(at(0), n, at(1), T, d, at(2), 1e-5f, at(2) - 3, nullptr); }), "h", "u"));
  CHECK(names(err([&] { ka::block_rinv<float>(at(0), T, d, 1e-5f, at(0) + 1, nullptr); }), "rinv", "block"));
  CHECK(names(err([&] { ka::phase1<float>(at(0), at(1), n, T, d, at(2), nq, at(3), at(3) + 4, nullptr); }), "o", "lse"));
  CHECK(names(err([&] { ka::phase1<float>(at(0), at(1), n, T, d, at(2), nq, at(3), at(1), nullptr); }), "lse", "rinv"));
  CHECK(names(err([&] { ka::phase2_add<float>(at(0), at(1), at(2), at(3), at(4), T, d, 1e-5f, at(2) + 1, nullptr); }), "prefix", "h"));
  CHECK(names(err([&] { ka::phase2_add<float>(at(0), at(1), at(3), at(3), at(4), T, d, 1e-5f, at(5), nullptr); }), "prefix", "delta"));
  CHECK(names(err([&] {
                ka::mix_backward<float>(at(0), n, at(1), T, d, at(2), at(3), 1e-5f, at(4), at(5), at(6), at(2), at(7), at(8), nullptr);
              }),
              "dw", "w"));
  CHECK(names(err([&] {
                ka::mix_backward<float>(at(0), n, at(1), T, d, at(2), at(3), 1e-5f, at(4), at(5), at(6), at(7), at(8), at(8), nullptr);
              }),
              "dgain", "du_workspace"));
}
