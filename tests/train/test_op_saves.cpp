// KDA's and the LatentMoE layer's training paths on a saved-tensor store
// (k3/train/kda_saves.hpp, k3/train/latent_moe_saves.hpp): under keep and offload (prefetched or
// not), and with the states recomputed, the gradients are those of the ops' own saved-state
// backward bit for bit, after the caller overwrote its inputs; fp8 stays within E4M3's
// rounding; integers are never FP8; the pools are empty afterwards; recompute of the caller's
// tensors is an error.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "k3/backend/cpu/simd.hpp"
#include "k3/train/kda_saves.hpp"
#include "k3/train/latent_moe_saves.hpp"
#include "support/error_of.hpp"
#include "support/metrics.hpp"
#include "support/random.hpp"

namespace tr = k3::train;
using k3::index_t;
using backend = k3::cpu::threads<>;

namespace {

std::vector<float> floats(std::size_t n, unsigned seed, double scale, double offset = 0.0) {
  auto const g = k3::test::gaussian(n, seed, scale);
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>(g[i] + offset);
  return v;
}

template <class T>
bool same_bits(std::vector<T> const& a, std::vector<T> const& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// One varlen KDA problem (an empty sequence among three, 70 tokens, grouped value heads, h0).
struct kda_problem {
  index_t T = 70, H = 1, HV = 2, K = 16, V = 8, N = 3;
  std::vector<std::int64_t> cu{0, 30, 30, 70};
  std::vector<float> q, k, v, g, beta, h0, d_o;
  kda_problem() {
    q = floats(std::size_t(T * H * K), 1, 0.3);
    k = floats(std::size_t(T * H * K), 2, 0.3);
    v = floats(std::size_t(T * HV * V), 3, 1.0);
    g = floats(std::size_t(T * HV * K), 4, 0.5);
    for (auto& x : g) x = -std::abs(x) - 0.01f;  // inside the lower bound -5 (with probability ~1)
    for (auto& x : g) x = std::max(x, -4.9f);
    beta = floats(std::size_t(T * HV), 5, 0.2, 0.5);
    h0 = floats(std::size_t(N * HV * K * V), 6, 0.5);
    d_o = floats(std::size_t(T * HV * V), 7, 1.0);
  }
  k3::kda::options options() const {
    k3::kda::options o;
    o.gate_lower_bound = -5.0;
    o.cu_seqlens = k3::tensor_view<std::int64_t const, 1>(cu.data(), {N + 1});
    return o;
  }
};

struct kda_grads {
  std::vector<float> dq, dk, dv, dg, dbeta, dh0;
  std::vector<float> all() const {
    std::vector<float> a;
    for (auto const* v : {&dq, &dk, &dv, &dg, &dbeta, &dh0}) a.insert(a.end(), v->begin(), v->end());
    return a;
  }
};

// The backward's gradient views over r's buffers.
k3::kda::backward_args<float> grad_args(kda_problem& p, kda_grads& r) {
  r.dq.assign(p.q.size(), 0.f);
  r.dk.assign(p.k.size(), 0.f);
  r.dv.assign(p.v.size(), 0.f);
  r.dg.assign(p.g.size(), 0.f);
  r.dbeta.assign(p.beta.size(), 0.f);
  r.dh0.assign(p.h0.size(), 0.f);
  k3::kda::backward_args<float> a;
  a.d_o = k3::tensor_view<float const, 4>(p.d_o.data(), {1, p.T, p.HV, p.V});
  a.dq = k3::tensor_view<float, 4>(r.dq.data(), {1, p.T, p.H, p.K});
  a.dk = k3::tensor_view<float, 4>(r.dk.data(), {1, p.T, p.H, p.K});
  a.dv = k3::tensor_view<float, 4>(r.dv.data(), {1, p.T, p.HV, p.V});
  a.dg = k3::tensor_view<float, 4>(r.dg.data(), {1, p.T, p.HV, p.K});
  a.dbeta = k3::tensor_view<float, 3>(r.dbeta.data(), {1, p.T, p.HV});
  a.dh0 = k3::tensor_view<float, 4>(r.dh0.data(), {p.N, p.HV, p.K, p.V});
  return a;
}

k3::kda::forward_args<float> fwd_args(kda_problem& p, std::vector<float>& o) {
  o.assign(std::size_t(p.T * p.HV * p.V), 0.f);
  k3::kda::forward_args<float> a;
  a.q = k3::tensor_view<float const, 4>(p.q.data(), {1, p.T, p.H, p.K});
  a.k = k3::tensor_view<float const, 4>(p.k.data(), {1, p.T, p.H, p.K});
  a.v = k3::tensor_view<float const, 4>(p.v.data(), {1, p.T, p.HV, p.V});
  a.g = k3::tensor_view<float const, 4>(p.g.data(), {1, p.T, p.HV, p.K});
  a.beta = k3::tensor_view<float const, 3>(p.beta.data(), {1, p.T, p.HV});
  a.o = k3::tensor_view<float, 4>(o.data(), {1, p.T, p.HV, p.V});
  a.h0 = k3::tensor_view<float const, 4>(p.h0.data(), {p.N, p.HV, p.K, p.V});
  return a;
}

}  // namespace

TEST_CASE("kda on the store: keep, offload and recomputed states give the saved-state backward's gradients bit for bit") {
  backend b(2);
  kda_problem p;
  auto const opt = p.options();
  // Reference: the op's own knob, forward_args::saved passed to the backward.
  std::vector<float> o_ref, o;
  auto fa = fwd_args(p, o_ref);
  std::vector<float> saved(std::size_t([&] {
    auto const s = k3::kda::saved_shape(fa, opt);
    return s[0] * s[1] * s[2];
  }()));
  auto const ss = k3::kda::saved_shape(fa, opt);
  fa.saved = k3::tensor_view<float, 3>(saved.data(), {ss[0], ss[1], ss[2]});
  k3::kda::forward(b, fa, opt);
  kda_grads ref;
  auto ba = grad_args(p, ref);
  ba.q = fa.q;
  ba.k = fa.k;
  ba.v = fa.v;
  ba.g = fa.g;
  ba.beta = fa.beta;
  ba.h0 = fa.h0;
  ba.saved = fa.saved;
  k3::kda::backward(b, ba, opt);
  auto const want = ref.all();

  for (int c = 0; c < 5; ++c) {
    tr::kda_policies const pol = c == 0   ? tr::kda_policies{tr::keep, tr::keep}
                                 : c == 1 ? tr::kda_policies{tr::offload, tr::offload}
                                 : c == 2 ? tr::kda_policies{tr::keep, tr::recompute}
                                 : c == 3 ? tr::kda_policies{tr::offload, tr::keep}
                                          : tr::kda_policies{tr::fp8 | tr::offload, tr::fp8 | tr::offload};
    CAPTURE(c);
    kda_problem mine;
    tr::saved_tensor_store<backend> store(b);
    auto rec = tr::kda_forward(b, tr::kda_forward_args<backend, float>{&store, fwd_args(mine, o)}, {opt, pol});
    CHECK(same_bits(o, o_ref));
    std::size_t const input_bytes = (mine.q.size() + mine.k.size() + mine.v.size() + mine.g.size() + mine.beta.size() + mine.h0.size()) * 4;
    if (c < 4) CHECK(store.stats().saved_bytes == input_bytes + (c == 2 ? 0 : saved.size() * 4));
    // The caller's inputs are gone; the backward reads the store's.
    for (auto* x : {&mine.q, &mine.k, &mine.v, &mine.g, &mine.beta, &mine.h0}) std::fill(x->begin(), x->end(), 0.f);
    if (c == 1) tr::kda_prefetch(b, tr::kda_prefetch_args<backend, float>{&store, &rec});
    kda_grads got;
    tr::kda_backward(b, tr::kda_backward_args<backend, float>{&store, &rec, grad_args(p, got)}, opt);
    if (c < 4) {
      CHECK(same_bits(got.all(), want));
    } else {
      double const e = k3::test::rel_rms(got.all(), want);
      CAPTURE(e);
      CHECK(e > 0);
      CHECK(e < 0.125);
    }
    CHECK(store.size() == 0);
    CHECK(store.stats().resident_bytes == 0);
    CHECK(store.stats().host_bytes == 0);
  }
  tr::saved_tensor_store<backend> store(b);
  CHECK(k3::test::error_of([&] { (void)tr::kda_forward(b, tr::kda_forward_args<backend, float>{&store, fwd_args(p, o)}, {opt, {tr::recompute, tr::keep}}); })
            .find("policy recompute for 'inputs'") != std::string::npos);
  CHECK(k3::test::error_of([&] { (void)tr::kda_forward(b, tr::kda_forward_args<backend, float>{nullptr, fwd_args(p, o)}); })
            .find("kda_forward: arguments 'store', 'record': required") != std::string::npos);
}

namespace {

struct moe_problem {
  index_t T = 37, d = 12, n = 6, k = 3, l = 5, f = 7, s = 1, F = 4;
  std::vector<float> x, w_router, w_down, we_gate, we_up, we_down, norm_weight, w_up, ws_gate, ws_up, ws_down, dy;
  moe_problem() {
    x = floats(std::size_t(T * d), 11, 1.0);
    w_router = floats(std::size_t(n * d), 12, 0.3);
    w_down = floats(std::size_t(l * d), 13, 0.3);
    we_gate = floats(std::size_t(n * f * l), 14, 0.4);
    we_up = floats(std::size_t(n * f * l), 15, 0.4);
    we_down = floats(std::size_t(n * l * f), 16, 0.4);
    norm_weight = floats(std::size_t(l), 17, 0.1, 1.0);
    w_up = floats(std::size_t(d * l), 18, 0.4);
    ws_gate = floats(std::size_t(s * F * d), 19, 0.3);
    ws_up = floats(std::size_t(s * F * d), 20, 0.3);
    ws_down = floats(std::size_t(s * d * F), 21, 0.3);
    dy = floats(std::size_t(T * d), 22, 1.0);
  }
  k3::moe::latent_moe_args<float> args(std::vector<float>& y) {
    y.assign(std::size_t(T * d), 0.f);
    k3::moe::latent_moe_args<float> a;
    a.x = k3::const_view<float, 2>(x.data(), {T, d});
    a.w_router = k3::const_view<float, 2>(w_router.data(), {n, d});
    a.w_down = k3::const_view<float, 2>(w_down.data(), {l, d});
    a.we_gate = k3::const_view<float, 3>(we_gate.data(), {n, f, l});
    a.we_up = k3::const_view<float, 3>(we_up.data(), {n, f, l});
    a.we_down = k3::const_view<float, 3>(we_down.data(), {n, l, f});
    a.norm_weight = k3::const_view<float, 1>(norm_weight.data(), {l});
    a.w_up = k3::const_view<float, 2>(w_up.data(), {d, l});
    a.ws_gate = k3::const_view<float, 3>(ws_gate.data(), {s, F, d});
    a.ws_up = k3::const_view<float, 3>(ws_up.data(), {s, F, d});
    a.ws_down = k3::const_view<float, 3>(ws_down.data(), {s, d, F});
    a.y = k3::tensor_view<float, 2>(y.data(), {T, d});
    return a;
  }
};

struct moe_grads {
  std::vector<float> dx, dw_router, dw_down, dwe_gate, dwe_up, dwe_down, dnorm, dw_up, dws_gate, dws_up, dws_down;
  k3::moe::latent_moe_gradients<float> views(moe_problem& p) {
    auto z = [](std::vector<float>& v, std::size_t n) {
      v.assign(n, 0.f);
      return v.data();
    };
    k3::moe::latent_moe_gradients<float> g;
    g.dy = k3::const_view<float, 2>(p.dy.data(), {p.T, p.d});
    g.dx = k3::tensor_view<float, 2>(z(dx, p.x.size()), {p.T, p.d});
    g.dw_router = k3::tensor_view<float, 2>(z(dw_router, p.w_router.size()), {p.n, p.d});
    g.dw_down = k3::tensor_view<float, 2>(z(dw_down, p.w_down.size()), {p.l, p.d});
    g.dwe_gate = k3::tensor_view<float, 3>(z(dwe_gate, p.we_gate.size()), {p.n, p.f, p.l});
    g.dwe_up = k3::tensor_view<float, 3>(z(dwe_up, p.we_up.size()), {p.n, p.f, p.l});
    g.dwe_down = k3::tensor_view<float, 3>(z(dwe_down, p.we_down.size()), {p.n, p.l, p.f});
    g.dnorm_weight = k3::tensor_view<float, 1>(z(dnorm, p.norm_weight.size()), {p.l});
    g.dw_up = k3::tensor_view<float, 2>(z(dw_up, p.w_up.size()), {p.d, p.l});
    g.dws_gate = k3::tensor_view<float, 3>(z(dws_gate, p.ws_gate.size()), {p.s, p.F, p.d});
    g.dws_up = k3::tensor_view<float, 3>(z(dws_up, p.ws_up.size()), {p.s, p.F, p.d});
    g.dws_down = k3::tensor_view<float, 3>(z(dws_down, p.ws_down.size()), {p.s, p.d, p.F});
    return g;
  }
  std::vector<float> all() const {
    std::vector<float> a;
    for (auto const* v : {&dx, &dw_router, &dw_down, &dwe_gate, &dwe_up, &dwe_down, &dnorm, &dw_up, &dws_gate, &dws_up, &dws_down})
      a.insert(a.end(), v->begin(), v->end());
    return a;
  }
};

}  // namespace

TEST_CASE("latent_moe on the store: keep, offload and a recomputed state give the saved-state backward's gradients bit for bit") {
  backend b(2);
  k3::moe::latent_moe_options o;
  o.k = 3;
  moe_problem p;
  std::vector<float> y_ref, y;
  k3::moe::latent_moe_saved<float> saved;
  auto a = p.args(y_ref);
  a.saved = &saved;
  k3::moe::latent_moe_forward(b, a, o);
  std::size_t const state_bytes = saved.bytes();
  moe_grads ref;
  k3::moe::latent_moe_backward(b, k3::moe::latent_moe_backward_args<float>{a, ref.views(p)}, o);
  auto const want = ref.all();

  for (int c = 0; c < 5; ++c) {
    tr::latent_moe_policies const pol = c == 0   ? tr::latent_moe_policies{tr::keep, tr::keep, tr::keep}
                                        : c == 1 ? tr::latent_moe_policies{tr::offload, tr::offload, tr::offload}
                                        : c == 2 ? tr::latent_moe_policies{tr::keep, tr::recompute, tr::recompute}
                                        : c == 3 ? tr::latent_moe_policies{tr::keep, tr::recompute, tr::offload}
                                                 : tr::latent_moe_policies{tr::fp8, tr::fp8 | tr::offload, tr::fp8};
    CAPTURE(c);
    moe_problem mine;
    tr::saved_tensor_store<backend> store(b);
    auto rec = tr::latent_moe_forward(b, tr::latent_moe_forward_args<backend, float>{&store, mine.args(y)}, {o, pol});
    CHECK(same_bits(y, y_ref));
    std::size_t const x_bytes = mine.x.size() * 4;
    if (c == 0 || c == 1) CHECK(store.stats().saved_bytes == x_bytes + state_bytes);
    if (c == 2) CHECK(store.stats().saved_bytes == x_bytes);
    std::fill(mine.x.begin(), mine.x.end(), 0.f);
    if (c == 1) tr::latent_moe_prefetch(b, tr::latent_moe_prefetch_args<backend, float>{&store, &rec});
    moe_grads got;
    tr::latent_moe_backward(b, tr::latent_moe_backward_args<backend, float>{&store, &rec, mine.args(y), got.views(p)}, o);
    if (c < 4) {
      CHECK(same_bits(got.all(), want));
    } else {
      double const e = k3::test::rel_rms(got.all(), want);
      CAPTURE(e);
      CHECK(e > 0);
      CHECK(e < 0.125);
    }
    CHECK(store.size() == 0);
    CHECK(store.stats().resident_bytes == 0);
    CHECK(store.stats().host_bytes == 0);
  }
  tr::saved_tensor_store<backend> store(b);
  CHECK(k3::test::error_of([&] { (void)tr::latent_moe_forward(b, tr::latent_moe_forward_args<backend, float>{&store, p.args(y)}, {o, {tr::recompute, tr::keep, tr::keep}}); })
            .find("policy recompute for 'input'") != std::string::npos);
  CHECK(k3::test::error_of([&] { (void)tr::latent_moe_forward(b, tr::latent_moe_forward_args<backend, float>{nullptr, p.args(y)}); })
            .find("latent_moe_forward: arguments 'store', 'record': required") != std::string::npos);
  auto rec = tr::latent_moe_forward(b, tr::latent_moe_forward_args<backend, float>{&store, p.args(y)}, {o, {}});
  k3::moe::latent_moe_options other = o;
  other.k = 2;
  moe_grads g;
  CHECK(k3::test::error_of([&] { tr::latent_moe_backward(b, tr::latent_moe_backward_args<backend, float>{&store, &rec, p.args(y), g.views(p)}, other); }).find("options differ") !=
        std::string::npos);
}
