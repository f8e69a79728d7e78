// The public API: argument validation (named arguments, expected vs actual), NaN
// confinement, the decode step over a state pool (slots, in place, untouched slots bitwise
// unchanged), decode after a chunked prefill, and backend agreement.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "support/error_of.hpp"
#include "kda/kda_fixture.hpp"

using namespace k3;
using namespace k3::test;

namespace {

bool has(std::string const& s, std::string const& sub) { return s.find(sub) != std::string::npos; }

}  // namespace

// cu_seqlens is a view: binding it to a temporary vector (which would dangle) does not compile.
static_assert(std::is_constructible_v<kda::cu_seqlens_view, std::vector<std::int64_t> const&>);
static_assert(!std::is_constructible_v<kda::cu_seqlens_view, std::vector<std::int64_t>&&>);
static_assert(!std::is_constructible_v<kda::cu_seqlens_view, std::vector<std::int32_t>&&>);

TEST_CASE("forward and backward validate their arguments") {
  kda_case c{.B = 1, .T = 10, .H = 2, .HV = 4, .K = 8, .V = 6, .seed = 80};
  typed_data<float> d(make_data(c));
  std::vector<float> o(std::size_t(c.T * c.HV * c.V)), ht(std::size_t(c.HV * c.K * c.V));
  auto base = [&] {
    kda::forward_args<float> a;
    a.q = d.qv();
    a.k = d.kv();
    a.v = d.vv();
    a.g = d.gv();
    a.beta = d.bv();
    a.o = host_view(o.data(), c.B, c.T, c.HV, c.V);
    a.h0 = d.h0v();
    a.ht = host_view(ht.data(), c.N(), c.HV, c.K, c.V);
    return a;
  };
  CHECK_NOTHROW(kda::forward(cpu::serial{}, base()));

  auto a = base();
  a.k = host_view(d.k.data(), c.B, c.T, c.H, c.K - 1);
  std::string m = error_of([&] { kda::forward(cpu::serial{}, a); });
  CHECK(has(m, "'k'"));
  CHECK(has(m, "[1, 10, 2, 8]"));
  CHECK(has(m, "[1, 10, 2, 7]"));

  a = base();
  a.q = host_view(d.q.data(), c.B, c.T, 3, c.K - 2);  // 3 heads do not divide HV = 4
  CHECK(has(error_of([&] { kda::forward(cpu::serial{}, a); }), "multiple of the q/k heads"));

  a = base();
  a.o = host_view(const_cast<float*>(d.v.data()), c.B, c.T, c.HV, c.V);
  CHECK(has(error_of([&] { kda::forward(cpu::serial{}, a); }), "overlap"));

  a = base();
  a.ht = host_view(o.data(), c.N(), c.HV, c.K, c.V - 5);
  CHECK(has(error_of([&] { kda::forward(cpu::serial{}, a); }), "'ht'"));

  a = base();
  a.h0 = host_view(d.h0.data(), 2, c.HV, c.K, c.V);
  CHECK(has(error_of([&] { kda::forward(cpu::serial{}, a); }), "'h0'"));

  a = base();
  kda::options opt;
  opt.scale = NAN;
  CHECK(has(error_of([&] { kda::forward(cpu::serial{}, a, opt); }), "'scale'"));

  // cu_seqlens rules
  a = base();
  a.h0 = {};
  a.ht = {};
  auto cu_err = [&](std::vector<std::int64_t> cu) {
    kda::options o2;
    o2.cu_seqlens = cu;
    return error_of([&] { kda::forward(cpu::serial{}, a, o2); });
  };
  CHECK(cu_err({0, 4, 10}) == "");
  CHECK(has(cu_err({0, 6, 4, 10}), "non-decreasing"));
  CHECK(has(cu_err({0, 4, 9}), "last offset"));
  CHECK(has(cu_err({1, 4, 10}), "first offset"));
  CHECK(has(cu_err({}), "cu_seqlens"));
  std::vector<std::int32_t> cu32{0, 3, 10};
  kda::options o3;
  o3.cu_seqlens = tensor_view<std::int32_t const, 1>(cu32.data(), {3});
  CHECK_NOTHROW(kda::forward(cpu::serial{}, a, o3));
  {
    kda_case c2{.B = 2, .T = 5, .H = 1, .HV = 1, .K = 4, .V = 4, .seed = 81};
    typed_data<float> d2(make_data(c2));
    std::vector<float> o2(std::size_t(c2.B * c2.T * c2.V));
    kda::forward_args<float> a2;
    a2.q = d2.qv();
    a2.k = d2.kv();
    a2.v = d2.vv();
    a2.g = d2.gv();
    a2.beta = d2.bv();
    a2.o = host_view(o2.data(), c2.B, c2.T, c2.HV, c2.V);
    kda::options o4;
    std::vector<std::int64_t> const cu05{0, 5};
    o4.cu_seqlens = cu05;
    CHECK(has(error_of([&] { kda::forward(cpu::serial{}, a2, o4); }), "B = 1"));
  }

  // gate lower bound: range of the option and of g
  a = base();
  kda::options lbo;
  lbo.gate_lower_bound = -6;
  CHECK(has(error_of([&] { kda::forward(cpu::serial{}, a, lbo); }), "gate_lower_bound"));
  lbo.gate_lower_bound = -0.01;  // the logsigmoid gate goes below this
  CHECK(has(error_of([&] { kda::forward(cpu::serial{}, a, lbo); }), "argument 'g'"));
  {
    // The vectorised chunked forward checks the bound while staging g's rows (no separate
    // pass): one value below it anywhere (here the last token of the last head, and a token in
    // the middle of the second of two sequences) is still an error naming it, on any thread count.
    std::vector<float> g = d.g;
    for (auto& x : g) x = std::max(x, -4.f);
    a = base();
    a.g = host_view(g.data(), c.B, c.T, c.HV, c.K);
    a.h0 = {};
    a.ht = {};
    kda::options ok;
    ok.gate_lower_bound = -4.f;
    std::vector<std::int64_t> const two_seqs{0, 4, c.T};
    for (int threads : {1, 2, 3}) {
      cpu::threads<> be(threads);
      CHECK(error_of([&] { kda::forward(be, a, ok); }) == "");
      for (auto const& th : {std::pair{c.T - 1, c.HV - 1}, std::pair{index_t(6), index_t(1)}}) {
        index_t const t = th.first, h = th.second;  // not a structured binding: clang 14 cannot capture those
        float& x = g[std::size_t(((t * c.HV) + h) * c.K + 3)];
        float const keep = x;
        x = -4.0001f;
        ok.cu_seqlens = t == 6 ? kda::cu_seqlens_view(two_seqs) : kda::cu_seqlens_view();
        std::string const e = error_of([&] { kda::forward(be, a, ok); });
        INFO(e, " threads ", threads, " t ", t);
        CHECK(has(e, "argument 'g'"));
        CHECK(has(e, "[0, " + std::to_string(t) + ", " + std::to_string(h) + ", 3]"));
        x = keep;
        ok.cu_seqlens = {};
      }
    }
    // a bound that is not a float: g equal to it rounded up to float passes
    ok.gate_lower_bound = -3.9;
    for (auto& x : g) x = std::max(x, float(-3.9));
    CHECK(error_of([&] { kda::forward(cpu::threads<>(2), a, ok); }) == "");
  }

  // backward: outputs must not alias inputs or each other
  std::vector<float> dq(d.q.size()), dk(d.k.size()), dv(d.v.size()), dg(d.g.size()), db(d.beta.size());
  auto bbase = [&] {
    kda::backward_args<float> b;
    b.q = d.qv();
    b.k = d.kv();
    b.v = d.vv();
    b.g = d.gv();
    b.beta = d.bv();
    b.d_o = d.dov();
    b.dq = host_view(dq.data(), c.B, c.T, c.H, c.K);
    b.dk = host_view(dk.data(), c.B, c.T, c.H, c.K);
    b.dv = host_view(dv.data(), c.B, c.T, c.HV, c.V);
    b.dg = host_view(dg.data(), c.B, c.T, c.HV, c.K);
    b.dbeta = host_view(db.data(), c.B, c.T, c.HV);
    return b;
  };
  CHECK_NOTHROW(kda::backward(cpu::serial{}, bbase()));
  auto b = bbase();
  b.dk = host_view(dq.data(), c.B, c.T, c.H, c.K);
  CHECK(has(error_of([&] { kda::backward(cpu::serial{}, b); }), "overlap"));
  b = bbase();
  b.d_o = host_view(d.d_o.data(), c.B, c.T, c.HV, c.V - 1);
  CHECK(has(error_of([&] { kda::backward(cpu::serial{}, b); }), "'do'"));

  // saved states: shape [HV, chunks, record], chunked form only, apart from the other arguments
  auto sh = kda::saved_shape(base());
  CHECK(sh[0] == c.HV);
  CHECK(sh[1] == 1);
  CHECK(sh == kda::saved_shape(bbase()));
  std::vector<float> sv(std::size_t(sh[0] * sh[1] * sh[2]));
  a = base();
  a.saved = host_view(sv.data(), sh[0], sh[1], sh[2]);
  CHECK_NOTHROW(kda::forward(cpu::threads<>(2), a));
  b = bbase();
  b.saved = host_view(static_cast<float const*>(sv.data()), sh[0], sh[1], sh[2]);
  CHECK_NOTHROW(kda::backward(cpu::threads<>(2), b));
  a.saved = host_view(sv.data(), sh[0], sh[1] + 1, sh[2] - 1);
  m = error_of([&] { kda::forward(cpu::serial{}, a); });
  CHECK(has(m, "'saved'"));
  CHECK(has(m, "[" + std::to_string(sh[0]) + ", " + std::to_string(sh[1]) + ", " + std::to_string(sh[2]) + "]"));
  b.saved = host_view(static_cast<float const*>(sv.data()), sh[0] - 1, sh[1], sh[2]);
  CHECK(has(error_of([&] { kda::backward(cpu::serial{}, b); }), "'saved'"));
  kda::options rec;
  rec.mode = kda::algorithm::recurrent;
  a.saved = host_view(sv.data(), sh[0], sh[1], sh[2]);
  CHECK(has(error_of([&] { kda::forward(cpu::serial{}, a, rec); }), "chunked form"));
  b.saved = host_view(static_cast<float const*>(sv.data()), sh[0], sh[1], sh[2]);
  CHECK(has(error_of([&] { kda::backward(cpu::serial{}, b, rec); }), "chunked form"));
  std::vector<float> big(sv.size());  // saved sharing memory with o (forward) or dq (backward)
  a.saved = host_view(big.data(), sh[0], sh[1], sh[2]);
  a.o = host_view(big.data() + 7, c.B, c.T, c.HV, c.V);
  m = error_of([&] { kda::forward(cpu::serial{}, a); });
  CHECK(has(m, "overlap"));
  CHECK(has(m, "'saved'"));
  b.saved = host_view(static_cast<float const*>(big.data()), sh[0], sh[1], sh[2]);
  b.dq = host_view(big.data() + 7, c.B, c.T, c.H, c.K);
  m = error_of([&] { kda::backward(cpu::serial{}, b); });
  CHECK(has(m, "overlap"));
  CHECK(has(m, "'saved'"));
}

TEST_CASE("a NaN stays in its sequence or head") {
  kda_case c{.B = 1, .T = 150, .H = 2, .HV = 4, .K = 16, .V = 8, .cu = {0, 40, 100, 150}, .seed = 90};
  kda_data64 clean = make_data(c), dirty = clean;
  // NaN in v of sequence 1 (token 50), value head 1 (q/k head 0).
  dirty.v[std::size_t((50 * c.HV + 1) * c.V + 3)] = NAN;
  for (int variant : {0, 1, 2}) {  // chunk, chunk with saved states, recurrent
    auto const m = variant == 2 ? kda::algorithm::recurrent : kda::algorithm::chunk;
    typed_data<float> tc(clean), td(dirty);
    saved_states<float> sc, sd;
    auto fc = run_forward(tc, m, cpu::threads<>(2), variant == 1 ? &sc : nullptr);
    auto fd = run_forward(td, m, cpu::threads<>(2), variant == 1 ? &sd : nullptr);
    auto bc = run_backward(tc, m, cpu::threads<>(2), variant == 1 ? &sc : nullptr);
    auto bd = run_backward(td, m, cpu::threads<>(2), variant == 1 ? &sd : nullptr);
    bool nan_seen = false;
    for (index_t t = 0; t < c.T; ++t)
      for (index_t hv = 0; hv < c.HV; ++hv) {
        INFO("mode " << int(m) << " t " << t << " hv " << hv);
        bool const hit = t >= 40 && t < 100 && hv == 1;
        for (index_t e = 0; e < c.V; ++e) {
          std::size_t i = std::size_t((t * c.HV + hv) * c.V + e);
          if (hit)
            nan_seen |= std::isnan(fd.o[i]);
          else
            REQUIRE(fd.o[i] == fc.o[i]);
          if (!hit) REQUIRE(bd.dv[i] == bc.dv[i]);
        }
        for (index_t d = 0; d < c.K; ++d) {
          std::size_t i = std::size_t((t * c.HV + hv) * c.K + d);
          if (!hit) REQUIRE(bd.dg[i] == bc.dg[i]);
        }
      }
    CHECK(nan_seen);
    // dq/dk of q/k head 1 and of other sequences are clean.
    for (index_t t = 0; t < c.T; ++t)
      for (index_t h = 0; h < c.H; ++h)
        if (!(t >= 40 && t < 100 && h == 0))
          for (index_t d = 0; d < c.K; ++d) {
            std::size_t i = std::size_t((t * c.H + h) * c.K + d);
            REQUIRE(bd.dq[i] == bc.dq[i]);
            REQUIRE(bd.dk[i] == bc.dk[i]);
          }
    index_t const per = c.HV * c.K * c.V;
    for (index_t n : {0, 2})
      for (index_t i = 0; i < per; ++i) REQUIRE(fd.ht[std::size_t(n * per + i)] == fc.ht[std::size_t(n * per + i)]);
  }
}

TEST_CASE("backends agree: threads vs serial, chunk and recurrent (float)") {
  kda_case c{.B = 2, .T = 333, .H = 2, .HV = 4, .K = 32, .V = 48, .seed = 95};
  typed_data<float> d(make_data(c));
  for (auto m : {kda::algorithm::chunk, kda::algorithm::recurrent}) {
    auto s = run_forward(d, m, cpu::serial{});
    auto t = run_forward(d, m, cpu::threads<>(2));
    auto v = run_forward(d, m, cpu::simd<>{});
    CHECK(rel_rms(t.o, s.o) < 1e-6);
    CHECK(rel_rms(t.ht, s.ht) < 1e-6);
    CHECK(rel_rms(v.o, s.o) < 1e-6);
    auto sb = run_backward(d, m, cpu::serial{});
    auto tb = run_backward(d, m, cpu::threads<>(2));
    CHECK(rel_rms(tb.dq, sb.dq) < 1e-6);
    CHECK(rel_rms(tb.dg, sb.dg) < 1e-6);
    CHECK(rel_rms(tb.dh0, sb.dh0) < 1e-6);
  }
}

namespace {

// Runs decode for tokens of `d` at time t into the pool (slots[n] for batch row n).
template <class Slot, class Backend>
void decode_token(typed_data<double> const& d, index_t t, std::vector<double>& pool, index_t P, std::vector<Slot> const& slots,
                  std::vector<double>& o, Backend const& be) {
  auto const& c = d.c;
  index_t const N = c.B;
  // gather token t of every batch row into [N, ...] arrays
  std::vector<double> q(std::size_t(N * c.H * c.K)), k(q.size()), v(std::size_t(N * c.HV * c.V)), g(std::size_t(N * c.HV * c.K)),
      beta(std::size_t(N * c.HV));
  for (index_t n = 0; n < N; ++n) {
    for (index_t i = 0; i < c.H * c.K; ++i) {
      q[std::size_t(n * c.H * c.K + i)] = d.q[std::size_t((n * c.T + t) * c.H * c.K + i)];
      k[std::size_t(n * c.H * c.K + i)] = d.k[std::size_t((n * c.T + t) * c.H * c.K + i)];
    }
    for (index_t i = 0; i < c.HV * c.V; ++i) v[std::size_t(n * c.HV * c.V + i)] = d.v[std::size_t((n * c.T + t) * c.HV * c.V + i)];
    for (index_t i = 0; i < c.HV * c.K; ++i) g[std::size_t(n * c.HV * c.K + i)] = d.g[std::size_t((n * c.T + t) * c.HV * c.K + i)];
    for (index_t i = 0; i < c.HV; ++i) beta[std::size_t(n * c.HV + i)] = d.beta[std::size_t((n * c.T + t) * c.HV + i)];
  }
  o.assign(std::size_t(N * c.HV * c.V), 0);
  kda::decode_args<double> a;
  a.q = host_view(q.data(), N, c.H, c.K);
  a.k = host_view(k.data(), N, c.H, c.K);
  a.v = host_view(v.data(), N, c.HV, c.V);
  a.g = host_view(g.data(), N, c.HV, c.K);
  a.beta = host_view(beta.data(), N, c.HV);
  a.o = host_view(o.data(), N, c.HV, c.V);
  a.state_pool = host_view(pool.data(), P, c.HV, c.K, c.V);
  if constexpr (std::is_same_v<Slot, std::int32_t>)
    a.slots32 = host_view(slots.data(), N);
  else
    a.slots64 = host_view(slots.data(), N);
  kda::decode(be, a);
}

}  // namespace

TEST_CASE("decode after a chunked prefill matches the whole sequence chunked") {
  kda_case c{.B = 2, .T = 90, .H = 1, .HV = 2, .K = 20, .V = 40, .seed = 100};  // V: SIMD path and remainder
  kda_data64 d64 = make_data(c);
  typed_data<double> full(d64);
  auto whole = run_forward(full, kda::algorithm::chunk);
  index_t const T0 = 70, P = 5;
  // prefill: the first T0 tokens, chunked
  kda_case cp = c;
  cp.T = T0;
  kda_data64 pre = d64;
  pre.c = cp;
  auto cut = [&](std::vector<double>& x, index_t per) {
    std::vector<double> y;
    for (index_t b = 0; b < c.B; ++b)
      y.insert(y.end(), x.begin() + b * c.T * per, x.begin() + (b * c.T + T0) * per);
    x = y;
  };
  cut(pre.q, c.H * c.K);
  cut(pre.k, c.H * c.K);
  cut(pre.v, c.HV * c.V);
  cut(pre.g, c.HV * c.K);
  cut(pre.beta, c.HV);
  cut(pre.d_o, c.HV * c.V);
  auto pf = run_forward(typed_data<double>(pre), kda::algorithm::chunk);
  std::vector<double> pool(std::size_t(P * c.HV * c.K * c.V), 0.25);
  std::vector<std::int64_t> slots{3, 1};
  index_t const per = c.HV * c.K * c.V;
  for (index_t n = 0; n < c.B; ++n)
    std::copy(pf.ht.begin() + n * per, pf.ht.begin() + (n + 1) * per, pool.begin() + slots[std::size_t(n)] * per);
  std::vector<double> pool_before = pool;
  std::vector<double> o, ref, got;
  for (index_t t = T0; t < c.T; ++t) {
    decode_token(full, t, pool, P, slots, o, t % 2 ? cpu::threads<>(2) : cpu::threads<>(1));
    for (index_t n = 0; n < c.B; ++n)
      for (index_t i = 0; i < c.HV * c.V; ++i) {
        got.push_back(o[std::size_t(n * c.HV * c.V + i)]);
        ref.push_back(whole.o[std::size_t((n * c.T + t) * c.HV * c.V + i)]);
      }
  }
  CHECK(rel_rms(got, ref) < 1e-12);
  std::vector<double> st_ref, st_got;
  for (index_t n = 0; n < c.B; ++n)
    for (index_t i = 0; i < per; ++i) {
      st_ref.push_back(whole.ht[std::size_t(n * per + i)]);
      st_got.push_back(pool[std::size_t(slots[std::size_t(n)] * per + i)]);
    }
  CHECK(rel_rms(st_got, st_ref) < 1e-12);
  for (index_t s : {0, 2, 4})
    for (index_t i = 0; i < per; ++i) REQUIRE(pool[std::size_t(s * per + i)] == pool_before[std::size_t(s * per + i)]);

  // int32 slots give the same result as the recurrent forward on T = 1 with h0 from the pool.
  std::vector<std::int32_t> s32{4, 0};
  std::vector<double> pool2(std::size_t(P * per));
  for (std::size_t i = 0; i < pool2.size(); ++i) pool2[i] = std::sin(double(i));
  std::vector<double> pool2_before = pool2;
  decode_token(full, 0, pool2, P, s32, o, cpu::serial{});
  kda_case c1 = c;
  c1.T = 1;
  kda_data64 one = d64;
  one.c = c1;
  cut(one.q, c.H * c.K);  // first T0 tokens; keep the first below
  auto first = [&](std::vector<double>& x, index_t per_tok) {
    std::vector<double> y;
    for (index_t b = 0; b < c.B; ++b) y.insert(y.end(), x.begin() + b * T0 * per_tok, x.begin() + (b * T0 + 1) * per_tok);
    x = y;
  };
  first(one.q, c.H * c.K);
  cut(one.k, c.H * c.K);
  first(one.k, c.H * c.K);
  cut(one.v, c.HV * c.V);
  first(one.v, c.HV * c.V);
  cut(one.g, c.HV * c.K);
  first(one.g, c.HV * c.K);
  cut(one.beta, c.HV);
  first(one.beta, c.HV);
  one.d_o.assign(std::size_t(c.B * c.HV * c.V), 0);
  one.h0.assign(std::size_t(c.B * per), 0);
  for (index_t n = 0; n < c.B; ++n)
    std::copy(pool2_before.begin() + s32[std::size_t(n)] * per, pool2_before.begin() + (s32[std::size_t(n)] + 1) * per,
              one.h0.begin() + n * per);
  auto r1 = run_forward(typed_data<double>(one), kda::algorithm::recurrent);
  CHECK(rel_rms(o, r1.o) < 1e-15);
  for (index_t n = 0; n < c.B; ++n)
    for (index_t i = 0; i < per; ++i)
      REQUIRE(pool2[std::size_t(s32[std::size_t(n)] * per + i)] == doctest::Approx(r1.ht[std::size_t(n * per + i)]).epsilon(1e-14));
}

TEST_CASE("decode validates slots") {
  index_t const N = 2, H = 1, HV = 1, K = 4, V = 4, P = 3;
  std::vector<float> q(std::size_t(N * H * K), 0.1f), k(q), v(std::size_t(N * HV * V), 1.f), g(std::size_t(N * HV * K), -0.1f),
      beta(std::size_t(N * HV), 0.5f), o(std::size_t(N * HV * V)), pool(std::size_t(P * HV * K * V));
  auto mk = [&] {
    kda::decode_args<float> a;
    a.q = host_view(q.data(), N, H, K);
    a.k = host_view(k.data(), N, H, K);
    a.v = host_view(v.data(), N, HV, V);
    a.g = host_view(g.data(), N, HV, K);
    a.beta = host_view(beta.data(), N, HV);
    a.o = host_view(o.data(), N, HV, V);
    a.state_pool = host_view(pool.data(), P, HV, K, V);
    return a;
  };
  std::vector<std::int32_t> ok{2, 0}, out{0, 3}, neg{-1, 0}, dup{1, 1};
  std::vector<std::int64_t> big{0, std::int64_t(1) << 40};
  auto a = mk();
  a.slots32 = host_view(ok.data(), N);
  CHECK_NOTHROW(kda::decode(cpu::serial{}, a));
  a.slots32 = host_view(out.data(), N);
  std::string m = error_of([&] { kda::decode(cpu::serial{}, a); });
  CHECK(has(m, "'slots'"));
  CHECK(has(m, "out of range"));
  a.slots32 = host_view(neg.data(), N);  // a negative slot is padding: skipped, its o untouched
  std::fill(o.begin(), o.end(), 9.f);
  CHECK_NOTHROW(kda::decode(cpu::serial{}, a));
  for (index_t i = 0; i < HV * V; ++i) CHECK(o[std::size_t(i)] == 9.f);
  CHECK(o[std::size_t(HV * V)] != 9.f);
  a.slots32 = host_view(dup.data(), N);
  CHECK(has(error_of([&] { kda::decode(cpu::serial{}, a); }), "twice"));
  a = mk();
  a.slots64 = host_view(big.data(), N);
  CHECK(has(error_of([&] { kda::decode(cpu::serial{}, a); }), "out of range"));
  a = mk();
  CHECK(has(error_of([&] { kda::decode(cpu::serial{}, a); }), "slots"));
  a = mk();
  a.slots32 = host_view(ok.data(), N);
  a.state_pool = host_view(pool.data(), P, HV, K, V - 1);
  CHECK(has(error_of([&] { kda::decode(cpu::serial{}, a); }), "'state_pool'"));
}

// algorithm::automatic (the default): the recurrence for a forward alone, the chunked form for a
// forward that fills `saved` and for the backward, the same bits as asking for that form.
TEST_CASE("kda: the automatic form runs the form it names, bit for bit") {
  kda_case c{.B = 1, .T = 77, .H = 1, .HV = 2, .K = 12, .V = 20, .cu = {0, 30, 30, 77}, .gate = gate_kind::lower_bound, .seed = 41};
  typed_data<float> d(make_data(c));
  cpu::threads<> be(2);
  kda::forward_args<float> fa;
  CHECK(kda::options{}.mode == kda::algorithm::automatic);
  CHECK(kda::chosen_form(be, fa) == kda::algorithm::recurrent);
  kda::options rec;
  rec.mode = kda::algorithm::recurrent;
  CHECK(kda::chosen_form(be, fa, rec) == kda::algorithm::recurrent);
  kda::backward_args<float> ba;
  CHECK(kda::chosen_form(cpu::serial{}, ba) == kda::algorithm::chunk);
  CHECK(kda::chosen_form(cpu::serial{}, ba, rec) == kda::algorithm::recurrent);

  // A forward alone: the recurrence (it differs from the chunked form in its last bits here).
  auto const fa_auto = run_forward(d, kda::algorithm::automatic, be);
  auto const fa_rec = run_forward(d, kda::algorithm::recurrent, be);
  auto const fa_chunk = run_forward(d, kda::algorithm::chunk, be);
  CHECK(fa_auto.o == fa_rec.o);
  CHECK(fa_auto.ht == fa_rec.ht);
  CHECK(fa_rec.o != fa_chunk.o);

  // A training forward (saved states wanted): the chunked form, and the saved states it fills.
  saved_states<float> s_auto, s_chunk;
  auto const ft_auto = run_forward(d, kda::algorithm::automatic, be, &s_auto);
  auto const ft_chunk = run_forward(d, kda::algorithm::chunk, be, &s_chunk);
  fa.saved = s_auto.view();
  CHECK(kda::chosen_form(be, fa) == kda::algorithm::chunk);
  CHECK(ft_auto.o == ft_chunk.o);
  CHECK(ft_auto.ht == ft_chunk.ht);
  // The saved states are compared through what reads them (rows past a short chunk's end are
  // scratch, not part of the record): the backward below, bit for bit.
  REQUIRE(s_auto.data.size() == s_chunk.data.size());

  // The backward, with and without the saved states: the chunked form.
  for (bool with_saved : {false, true}) {
    CAPTURE(with_saved);
    auto const b_auto = run_backward(d, kda::algorithm::automatic, be, with_saved ? &s_auto : nullptr);
    auto const b_chunk = run_backward(d, kda::algorithm::chunk, be, with_saved ? &s_chunk : nullptr);
    CHECK(b_auto.dq == b_chunk.dq);
    CHECK(b_auto.dk == b_chunk.dk);
    CHECK(b_auto.dv == b_chunk.dv);
    CHECK(b_auto.dg == b_chunk.dg);
    CHECK(b_auto.dbeta == b_chunk.dbeta);
    CHECK(b_auto.dh0 == b_chunk.dh0);
  }
}
