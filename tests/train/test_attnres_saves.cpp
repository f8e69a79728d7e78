// The Block AttnRes driver's training path on a saved-tensor store (k3/train/attnres_saves.hpp):
// under keep and offload, and with the statistics recomputed, the gradients are train_stored's
// bit for bit; under fp8 they stay within E4M3's rounding of the partial sums; the store holds
// exactly each site's partial sum and statistics and is empty after the backward; a second
// forward releases what the first saved; policies that cannot apply are errors.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "k3/attnres.hpp"
#include "k3/backend/cpu/simd.hpp"
#include "k3/train/attnres_saves.hpp"
#include "support/error_of.hpp"
#include "support/metrics.hpp"

namespace ar = k3::attnres;
namespace tr = k3::train;
using k3::index_t;

namespace {

using backend = k3::cpu::threads<>;

struct toy {
  index_t L, S, T, d;
  std::vector<float> w, g, a, emb, dout;  // sublayer l: y = tanh(a_l * x)
  toy(index_t L_, index_t S_, index_t T_, index_t d_, unsigned seed) : L(L_), S(S_), T(T_), d(d_) {
    std::mt19937 gen(seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    auto fill = [&](std::vector<float>& v, std::size_t n, float sc, float off) {
      v.resize(n);
      for (auto& x : v) x = off + sc * nd(gen);
    };
    fill(w, std::size_t((L + 1) * d), 1.0f, 0.f);
    fill(g, std::size_t((L + 1) * d), 0.3f, 1.f);
    fill(a, std::size_t(L * d), 0.8f, 0.f);
    fill(emb, std::size_t(T * d), 1.f, 0.f);
    fill(dout, std::size_t(T * d), 1.f, 0.f);
  }
  ar::block_config config(ar::mode m) const {
    ar::block_config c;
    c.d = d;
    c.tokens = T;
    c.sublayers = L;
    c.block_sublayers = S;
    c.run_mode = m;
    return c;
  }
};

struct grads {
  std::vector<float> dw, dg, demb;
  std::vector<float> all() const {
    std::vector<float> v = dw;
    v.insert(v.end(), dg.begin(), dg.end());
    v.insert(v.end(), demb.begin(), demb.end());
    return v;
  }
};

std::vector<float> flat(k3::tensor_view<float const, 2> v) {
  std::vector<float> o;
  for (index_t i = 0; i < v.extent(0); ++i)
    for (index_t j = 0; j < v.extent(1); ++j) o.push_back(v(i, j));
  return o;
}

// Forward (passes times: the last one is differentiated) and backward through the driver.
grads run(ar::block_attn_res<float, backend>& drv, toy const& p, int passes = 1) {
  index_t const T = p.T, d = p.d;
  std::vector<std::vector<float>> inputs;
  std::vector<float> x(std::size_t(T * d)), y(std::size_t(T * d));
  for (int pass = 0; pass < passes; ++pass) {
    inputs.clear();
    drv.begin(k3::tensor_view<float const, 2>(p.emb.data(), {T, d}));
    drv.input(k3::tensor_view<float, 2>(x.data(), {T, d}));
    inputs.push_back(x);
    for (index_t l = 0; l < p.L; ++l) {
      for (index_t i = 0; i < T * d; ++i) y[std::size_t(i)] = std::tanh(p.a[std::size_t(l * d + i % d)] * x[std::size_t(i)]);
      drv.add(k3::tensor_view<float const, 2>(y.data(), {T, d}));
      if (l + 1 == p.L)
        drv.output(k3::tensor_view<float, 2>(x.data(), {T, d}));
      else
        drv.input(k3::tensor_view<float, 2>(x.data(), {T, d}));
      inputs.push_back(x);
    }
  }
  drv.backward_begin();
  drv.backward_site(k3::tensor_view<float const, 2>(p.dout.data(), {T, d}));
  std::vector<float> dx(std::size_t(T * d));
  for (index_t l = p.L - 1; l >= 0; --l) {
    auto gy = drv.grad_sublayer_output();
    auto const& xin = inputs[std::size_t(l)];
    for (index_t t = 0; t < T; ++t)
      for (index_t k = 0; k < d; ++k) {
        float const ax = p.a[std::size_t(l * d + k)], th = std::tanh(ax * xin[std::size_t(t * d + k)]);
        dx[std::size_t(t * d + k)] = gy(t, k) * ax * (1 - th * th);
      }
    drv.backward_site(k3::tensor_view<float const, 2>(dx.data(), {T, d}));
  }
  return {flat(drv.grad_w()), flat(drv.grad_gain()), flat(drv.grad_embedding())};
}

bool same_bits(std::vector<float> const& a, std::vector<float> const& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("attnres on the store: keep, offload and recomputed statistics give train_stored's gradients bit for bit") {
  backend b(2);
  for (auto const& shape : {std::array<index_t, 3>{6, 2, 37}, std::array<index_t, 3>{5, 1, 9}, std::array<index_t, 3>{7, 3, 1}}) {
    index_t const L = shape[0], S = shape[1], T = shape[2];
    CAPTURE(L);
    CAPTURE(S);
    toy const p(L, S, T, 13, unsigned(L * 7 + S));
    auto cfg = p.config(ar::mode::train_stored);
    k3::tensor_view<float const, 2> w(p.w.data(), {L + 1, p.d}), g(p.g.data(), {L + 1, p.d});
    ar::block_attn_res<float, backend> ref_drv(cfg, w, g, b);
    auto const ref = run(ref_drv, p).all();
    // Bytes each site saves: its partial sum (sites off a block boundary) and its statistics.
    std::size_t partial_bytes = 0, stats_bytes = 0;
    for (index_t l = 0; l <= L; ++l) {
      if (l == 0) continue;  // K3's first site takes the embedding itself: no mix
      if (cfg.partial_at(l)) partial_bytes += std::size_t(T * p.d) * 4;
      stats_bytes += std::size_t(T * cfg.sources_at(l) * 3) * 4;
    }
    for (auto const& policies : {std::pair{tr::keep, tr::keep}, std::pair{tr::offload, tr::offload}, std::pair{tr::keep, tr::recompute},
                                 std::pair{tr::offload, tr::keep}}) {
      tr::save_policy const pp = policies.first, ps = policies.second;
      CAPTURE(tr::policy_name(pp));
      CAPTURE(tr::policy_name(ps));
      tr::saved_tensor_store<backend> store(b);
      ar::block_attn_res<float, backend> drv(p.config(ar::mode::train_recompute), w, g, b);
      drv.save_sites_through(tr::attnres_site_saves<float>(store, pp, ps));
      auto const got = run(drv, p, 2).all();
      CHECK(same_bits(got, ref));
      auto const st = store.stats();
      // Two passes saved, the first one's entries released when the second replaced them.
      CHECK(st.saved_bytes == 2 * (partial_bytes + (ps == tr::recompute ? 0 : stats_bytes)));
      CHECK(st.resident_bytes == 0);
      CHECK(st.host_bytes == 0);
      CHECK(store.size() == 0);
      if (pp == tr::offload && ps == tr::offload) CHECK(st.resident_peak_bytes == 0);
    }
  }
}

TEST_CASE("attnres on the store: fp8 partial sums cost about a quarter of the bytes, the gradients move by the order of E4M3 rounding") {
  backend b(2);
  toy const p(8, 2, 40, 256, 5u);
  k3::tensor_view<float const, 2> w(p.w.data(), {p.L + 1, p.d}), g(p.g.data(), {p.L + 1, p.d});
  ar::block_attn_res<float, backend> ref_drv(p.config(ar::mode::train_stored), w, g, b);
  auto const ref = run(ref_drv, p).all();
  tr::saved_tensor_store<backend> keep_store(b), fp8_store(b);
  ar::block_attn_res<float, backend> kd(p.config(ar::mode::train_stored), w, g, b), fd(p.config(ar::mode::train_stored), w, g, b);
  kd.save_sites_through(tr::attnres_site_saves<float>(keep_store, tr::keep, tr::recompute));
  fd.save_sites_through(tr::attnres_site_saves<float>(fp8_store, tr::fp8, tr::recompute));
  CHECK(same_bits(run(kd, p).all(), ref));
  double const e = k3::test::rel_rms(run(fd, p).all(), ref);
  CAPTURE(e);
  CHECK(e > 0);
  CHECK(e < 0.125);  // each partial sum rounded to 3 mantissa bits, through the softmax
  // 256 values per row: 256 code bytes and two float scales against 1024 bytes.
  CHECK(fp8_store.stats().saved_bytes * 1024 == keep_store.stats().saved_bytes * (256 + 8));
}

TEST_CASE("attnres on the store: errors") {
  backend b(1);
  toy const p(3, 1, 4, 5, 1u);
  k3::tensor_view<float const, 2> w(p.w.data(), {p.L + 1, p.d}), g(p.g.data(), {p.L + 1, p.d});
  tr::saved_tensor_store<backend> store(b);
  CHECK(k3::test::error_of([&] { (void)tr::attnres_site_saves<float>(store, tr::recompute, tr::keep); }).find("nothing can recompute them") !=
        std::string::npos);
  ar::block_attn_res<float, backend> inference(p.config(ar::mode::one_pass), w, g, b);
  CHECK(k3::test::error_of([&] { inference.save_sites_through(tr::attnres_site_saves<float>(store, tr::keep, tr::keep)); })
            .find("not built in a training mode") != std::string::npos);
  ar::block_attn_res<float, backend> drv(p.config(ar::mode::train_stored), w, g, b);
  ar::site_saves<float, float> half;
  half.save_partial = [](k3::tensor_view<float const, 2>) { return std::uint64_t(0); };
  CHECK(k3::test::error_of([&] { drv.save_sites_through(half); }).find("are required") != std::string::npos);
}
