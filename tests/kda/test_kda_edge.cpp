// Adversarial API checks: every input and output as a strided view (padded rows,
// batch and time dimensions swapped in memory) gives the same results as contiguous views on
// every backend and algorithm, forward and backward.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "support/error_of.hpp"
#include "k3/kda.hpp"
#include "k3/kda/preprocess.hpp"
#include "kda/kda_fixture.hpp"

using namespace k3;
using namespace k3::test;

namespace {

// A rank-R array stored with dimensions 0 and 1 swapped in memory and `pad` unused elements
// after every innermost row; the view keeps the logical order [e0, e1, ...].
template <class T, std::size_t R>
struct strided_buf {
  std::vector<T> mem;
  array<index_t, R> ext{}, str{};
  strided_buf(std::vector<T> const& src, array<index_t, R> e, index_t pad, T fill) : ext(e) {
    index_t const last = e[R - 1];
    index_t row = last + pad;
    // physical order: dim 1, dim 0, dims 2.. (dim R-1 innermost, padded)
    str[R - 1] = 1;
    index_t s = row;
    for (std::size_t r = R - 1; r-- > 2;) {
      str[r] = s;
      s *= e[r];
    }
    if constexpr (R >= 2) {
      if constexpr (R > 2) {
        str[0] = s;
        str[1] = s * e[0];
        s = str[1] * e[1];
      } else {
        str[0] = row;
        str[1] = 1;
        s = row * e[0];
      }
    }
    mem.assign(std::size_t(s + 1), fill);
    index_t n = 1;
    for (auto x : e) n *= x;
    for (index_t i = 0; i < n; ++i) {
      index_t rem = i, off = 0;
      for (std::size_t r = R; r-- > 0;) {
        off += (rem % e[r]) * str[r];
        rem /= e[r];
      }
      if (!src.empty()) mem[std::size_t(off)] = src[std::size_t(i)];
    }
  }
  tensor_view<T, R> view() { return tensor_view<T, R>(mem.data(), ext, str); }
  tensor_view<T const, R> cview() const { return tensor_view<T const, R>(mem.data(), ext, str); }
  std::vector<double> logical() const {
    index_t n = 1;
    for (auto x : ext) n *= x;
    std::vector<double> r(static_cast<std::size_t>(n));
    for (index_t i = 0; i < n; ++i) {
      index_t rem = i, off = 0;
      for (std::size_t d = R; d-- > 0;) {
        off += (rem % ext[d]) * str[d];
        rem /= ext[d];
      }
      r[std::size_t(i)] = load_as<double>(mem[std::size_t(off)]);
    }
    return r;
  }
};

void check_same(char const* what, std::vector<double> const& got, std::vector<double> const& ref) {
  REQUIRE(got.size() == ref.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  INFO(what);
  CHECK(std::sqrt(num / (den + 1e-300)) <= 1e-6);
}

template <class In, class Backend>
void strided_case(kda_case const& c, kda::algorithm m, Backend const& be) {
  using S = k3::accumulation_t<In>;
  typed_data<In, S> d(make_data(c));
  auto fr = run_forward<In, S>(d, m, be);
  auto br = run_backward<In, S>(d, m, be);
  index_t const N = c.N();
  In const poison = store_as<In>(-3.0);
  strided_buf<In, 4> q(d.q, {c.B, c.T, c.H, c.K}, 3, poison), k(d.k, {c.B, c.T, c.H, c.K}, 1, poison), v(d.v, {c.B, c.T, c.HV, c.V}, 5, poison),
      g(d.g, {c.B, c.T, c.HV, c.K}, 2, poison), dov(d.d_o, {c.B, c.T, c.HV, c.V}, 4, poison);
  strided_buf<In, 3> beta(d.beta, {c.B, c.T, c.HV}, 0, poison);
  strided_buf<S, 4> h0(d.h0, {N, c.HV, c.K, c.V}, 3, S(-3)), dht(d.dht, {N, c.HV, c.K, c.V}, 2, S(-3));
  strided_buf<In, 4> o({}, {c.B, c.T, c.HV, c.V}, 2, poison), dq({}, {c.B, c.T, c.H, c.K}, 1, poison), dk({}, {c.B, c.T, c.H, c.K}, 3, poison),
      dv({}, {c.B, c.T, c.HV, c.V}, 1, poison), dg({}, {c.B, c.T, c.HV, c.K}, 2, poison);
  strided_buf<In, 3> db({}, {c.B, c.T, c.HV}, 1, poison);
  strided_buf<S, 4> ht({}, {N, c.HV, c.K, c.V}, 1, S(-3)), dh0({}, {N, c.HV, c.K, c.V}, 2, S(-3));
  kda::options opt = d.opts(m);
  kda::forward_args<In, S> fa{.q = q.cview(), .k = k.cview(), .v = v.cview(), .g = g.cview(), .beta = beta.cview(), .o = o.view(),
                              .h0 = h0.cview(), .ht = ht.view()};
  kda::forward(be, fa, opt);
  check_same("o", o.logical(), fr.o);
  check_same("ht", ht.logical(), fr.ht);
  kda::backward_args<In, S> ba{.q = q.cview(), .k = k.cview(), .v = v.cview(), .g = g.cview(), .beta = beta.cview(), .h0 = h0.cview(),
                               .d_o = dov.cview(), .dht = dht.cview(), .dq = dq.view(), .dk = dk.view(), .dv = dv.view(), .dg = dg.view(),
                               .dbeta = db.view(), .dh0 = dh0.view()};
  kda::backward(be, ba, opt);
  check_same("dq", dq.logical(), br.dq);
  check_same("dk", dk.logical(), br.dk);
  check_same("dv", dv.logical(), br.dv);
  check_same("dg", dg.logical(), br.dg);
  check_same("dbeta", db.logical(), br.dbeta);
  check_same("dh0", dh0.logical(), br.dh0);
  // The padding between rows is never written.
  auto untouched = [&](auto const& buf, char const* name) {
    INFO(name);
    std::vector<double> all = buf.logical();
    double written = 0;
    for (auto x : buf.mem) written += load_as<double>(x) == load_as<double>(poison) ? 1 : 0;
    // every element outside the view still holds the poison (elements inside may too)
    std::size_t inside = all.size();
    CHECK(written + double(inside) >= double(buf.mem.size()));
  };
  untouched(o, "o");
  untouched(dq, "dq");
  untouched(dg, "dg");
}

}  // namespace

TEST_CASE("kda: strided views (padded rows, B and T swapped in memory) match contiguous views") {
  for (kda_case c : {kda_case{.B = 2, .T = 70, .H = 2, .HV = 4, .K = 16, .V = 24, .seed = 5},
                     kda_case{.B = 3, .T = 9, .H = 1, .HV = 1, .K = 5, .V = 7, .seed = 6},
                     kda_case{.B = 1, .T = 130, .H = 1, .HV = 2, .K = 32, .V = 16, .cu = {0, 1, 64, 64, 130}, .seed = 7}}) {
    for (auto m : {kda::algorithm::chunk, kda::algorithm::recurrent}) {
      CAPTURE(c.T);
      CAPTURE(int(m));
      strided_case<float>(c, m, cpu::serial{});
      strided_case<float>(c, m, cpu::simd<>{});
      strided_case<float>(c, m, cpu::threads<>(3));
      strided_case<double>(c, m, cpu::threads<>(2));
      strided_case<bfloat16>(c, m, cpu::simd<>{});
    }
  }
}

namespace {
// T = 0 (every sequence empty): ht = h0 and dh0 = dht exactly; nothing else is touched.
template <class Backend>
void empty_time_case(Backend const& be, kda::algorithm m, bool varlen) {
  index_t const B = varlen ? 1 : 2, N = varlen ? 3 : 2, H = 1, HV = 2, K = 5, V = 3;
  std::vector<float> none(1, 0.f), h0(std::size_t(N * HV * K * V)), dht(h0.size()), ht(h0.size(), -7.f), dh0(h0.size(), -7.f);
  for (std::size_t i = 0; i < h0.size(); ++i) {
    h0[i] = 0.1f * float(i) - 1.f;
    dht[i] = 0.05f * float(i) + 2.f;
  }
  std::vector<std::int64_t> cu(std::size_t(N + 1), 0);
  kda::options opt;
  opt.mode = m;
  if (varlen) opt.cu_seqlens = cu;
  auto e4 = [&](index_t d) { return host_view(static_cast<float const*>(none.data()), B, index_t(0), d == 0 ? H : HV, d == 0 ? K : d); };
  auto o4 = [&](index_t h, index_t d) { return host_view(none.data(), B, index_t(0), h, d); };
  kda::forward_args<float> fa{.q = e4(0), .k = e4(0), .v = e4(V), .g = e4(K), .beta = host_view(static_cast<float const*>(none.data()), B, index_t(0), HV),
                              .o = o4(HV, V), .h0 = host_view(static_cast<float const*>(h0.data()), N, HV, K, V), .ht = host_view(ht.data(), N, HV, K, V)};
  kda::forward(be, fa, opt);
  CHECK(ht == h0);
  kda::backward_args<float> ba{.q = e4(0), .k = e4(0), .v = e4(V), .g = e4(K), .beta = host_view(static_cast<float const*>(none.data()), B, index_t(0), HV),
                               .h0 = host_view(static_cast<float const*>(h0.data()), N, HV, K, V), .d_o = e4(V),
                               .dht = host_view(static_cast<float const*>(dht.data()), N, HV, K, V), .dq = o4(H, K), .dk = o4(H, K),
                               .dv = o4(HV, V), .dg = o4(HV, K), .dbeta = host_view(none.data(), B, index_t(0), HV),
                               .dh0 = host_view(dh0.data(), N, HV, K, V)};
  kda::backward(be, ba, opt);
  CHECK(dh0 == dht);
}
}  // namespace

TEST_CASE("kda: T = 0 (and empty packed sequences) passes the state through, forward and backward, every backend") {
  for (bool varlen : {false, true})
    for (auto m : {kda::algorithm::chunk, kda::algorithm::recurrent}) {
      CAPTURE(varlen);
      CAPTURE(int(m));
      empty_time_case(cpu::serial{}, m, varlen);
      empty_time_case(cpu::simd<>{}, m, varlen);
      empty_time_case(cpu::threads<>(5), m, varlen);
    }
}

namespace {
// Broadcast inputs (stride 0): g and beta the same for every token,
// k the same for every batch row; results equal those of the materialised tensors.
template <class Backend>
void broadcast_case(Backend const& be, kda::algorithm m) {
  kda_case c{.B = 2, .T = 67, .H = 2, .HV = 4, .K = 8, .V = 8, .seed = 11};
  auto d64 = make_data(c);
  index_t const B = c.B, T = c.T, H = c.H, HV = c.HV, K = c.K, V = c.V;
  std::vector<float> g1(std::size_t(B * HV * K)), b1(std::size_t(B * HV)), k1(std::size_t(T * H * K));
  for (std::size_t i = 0; i < g1.size(); ++i) g1[i] = float(d64.g[i]);
  for (std::size_t i = 0; i < b1.size(); ++i) b1[i] = float(d64.beta[i]);
  for (std::size_t i = 0; i < k1.size(); ++i) k1[i] = float(d64.k[i]);
  // materialise
  typed_data<float> full(d64);
  for (index_t b = 0; b < B; ++b)
    for (index_t t = 0; t < T; ++t) {
      for (index_t h = 0; h < HV; ++h) {
        for (index_t i = 0; i < K; ++i) full.g[std::size_t(((b * T + t) * HV + h) * K + i)] = g1[std::size_t((b * HV + h) * K + i)];
        full.beta[std::size_t((b * T + t) * HV + h)] = b1[std::size_t(b * HV + h)];
      }
      for (index_t h = 0; h < H; ++h)
        for (index_t i = 0; i < K; ++i) full.k[std::size_t(((b * T + t) * H + h) * K + i)] = k1[std::size_t((t * H + h) * K + i)];
    }
  auto fr = run_forward<float>(full, m, be);
  auto br = run_backward<float>(full, m, be);
  tensor_view<float const, 4> gv(g1.data(), {B, T, HV, K}, {HV * K, 0, K, 1});
  tensor_view<float const, 3> bv(b1.data(), {B, T, HV}, {HV, 0, 1});
  tensor_view<float const, 4> kv(k1.data(), {B, T, H, K}, {0, H * K, K, 1});
  std::vector<float> o(full.v.size()), ht(std::size_t(B * HV * K * V));
  kda::forward_args<float> fa{.q = full.qv(), .k = kv, .v = full.vv(), .g = gv, .beta = bv, .o = host_view(o.data(), B, T, HV, V),
                              .h0 = full.h0v(), .ht = host_view(ht.data(), B, HV, K, V)};
  kda::forward(be, fa, full.opts(m));
  check_same("o", to_double(o), fr.o);
  check_same("ht", to_double(ht), fr.ht);
  std::vector<float> dq(full.q.size()), dk(full.k.size()), dv(full.v.size()), dg(full.g.size()), db(full.beta.size()), dh0(ht.size());
  kda::backward_args<float> ba{.q = full.qv(), .k = kv, .v = full.vv(), .g = gv, .beta = bv, .h0 = full.h0v(), .d_o = full.dov(),
                               .dht = full.dhtv(), .dq = host_view(dq.data(), B, T, H, K), .dk = host_view(dk.data(), B, T, H, K),
                               .dv = host_view(dv.data(), B, T, HV, V), .dg = host_view(dg.data(), B, T, HV, K),
                               .dbeta = host_view(db.data(), B, T, HV), .dh0 = host_view(dh0.data(), B, HV, K, V)};
  kda::backward(be, ba, full.opts(m));
  check_same("dq", to_double(dq), br.dq);
  check_same("dk", to_double(dk), br.dk);
  check_same("dv", to_double(dv), br.dv);
  check_same("dg", to_double(dg), br.dg);
  check_same("dbeta", to_double(db), br.dbeta);
  check_same("dh0", to_double(dh0), br.dh0);
}
}  // namespace

TEST_CASE("kda: broadcast (stride-0) inputs give the results of the materialised tensors") {
  for (auto m : {kda::algorithm::chunk, kda::algorithm::recurrent}) {
    CAPTURE(int(m));
    broadcast_case(cpu::serial{}, m);
    broadcast_case(cpu::simd<>{}, m);
    broadcast_case(cpu::threads<>(4), m);
  }
}

TEST_CASE("kda decode: strided q, k, v, g, beta, o and pool (dims swapped, padded rows) match contiguous views, every backend") {
  index_t const N = 5, H = 2, HV = 4, K = 12, V = 10, P = 7;
  std::mt19937_64 rng(21);
  std::normal_distribution<double> nd(0.0, 1.0);
  auto randv = [&](index_t n, double sc, double off) {
    std::vector<float> x(static_cast<std::size_t>(n));
    for (auto& e : x) e = float(off + sc * nd(rng));
    return x;
  };
  std::vector<float> q = randv(N * H * K, 0.3, 0), k = randv(N * H * K, 0.3, 0), v = randv(N * HV * V, 1, 0), g = randv(N * HV * K, 0.1, -0.2),
                     beta = randv(N * HV, 0.1, 0.5), pool0 = randv(P * HV * K * V, 0.5, 0);
  std::vector<std::int32_t> slots{3, 0, 6, 2, 5};
  auto run_contig = [&](auto const& be) {
    std::vector<float> pool = pool0, o(static_cast<std::size_t>(N * HV * V));
    kda::decode_args<float> a{host_view(static_cast<float const*>(q.data()), N, H, K), host_view(static_cast<float const*>(k.data()), N, H, K),
                              host_view(static_cast<float const*>(v.data()), N, HV, V), host_view(static_cast<float const*>(g.data()), N, HV, K),
                              host_view(static_cast<float const*>(beta.data()), N, HV), host_view(o.data(), N, HV, V),
                              host_view(pool.data(), P, HV, K, V), host_view(static_cast<std::int32_t const*>(slots.data()), N)};
    kda::decode(be, a);
    o.insert(o.end(), pool.begin(), pool.end());
    return to_double(o);
  };
  auto run_strided = [&](auto const& be) {
    strided_buf<float, 3> qs(q, {N, H, K}, 3, -9.f), ks(k, {N, H, K}, 1, -9.f), vs(v, {N, HV, V}, 2, -9.f), gs(g, {N, HV, K}, 5, -9.f);
    strided_buf<float, 2> bs(beta, {N, HV}, 1, -9.f);
    strided_buf<float, 3> os({}, {N, HV, V}, 3, -9.f);
    strided_buf<float, 4> ps(pool0, {P, HV, K, V}, 6, -9.f);
    std::vector<std::int64_t> s64(slots.begin(), slots.end());  // the int64 slot path
    kda::decode_args<float> a{qs.cview(), ks.cview(), vs.cview(), gs.cview(), bs.cview(), os.view(), ps.view(), {},
                              host_view(static_cast<std::int64_t const*>(s64.data()), N)};
    kda::decode(be, a);
    std::vector<double> r = os.logical(), pl = ps.logical();
    r.insert(r.end(), pl.begin(), pl.end());
    return r;
  };
  auto const ref = run_contig(cpu::serial{});
  check_same("serial strided", run_strided(cpu::serial{}), ref);
  check_same("simd", run_contig(cpu::simd<>{}), ref);
  check_same("simd strided", run_strided(cpu::simd<>{}), ref);
  check_same("threads strided", run_strided(cpu::threads<>(3)), ref);
  check_same("threads(8) strided", run_strided(cpu::threads<>(8)), ref);
}

TEST_CASE("kda: an output or state pool with a stride-0 dimension (aliasing itself) is rejected") {
  kda_case c{.B = 2, .T = 5, .H = 1, .HV = 2, .K = 4, .V = 4, .seed = 3};
  typed_data<float> d(make_data(c));
  std::vector<float> o(d.v.size()), ht(std::size_t(c.N() * c.HV * c.K * c.V));
  auto err = [&](tensor_view<float, 4> ov, tensor_view<float, 4> htv) {
    kda::forward_args<float> a{.q = d.qv(), .k = d.kv(), .v = d.vv(), .g = d.gv(), .beta = d.bv(), .o = ov, .h0 = d.h0v(), .ht = htv};
    try {
      kda::forward(cpu::threads<>(2), a);
    } catch (k3::error const& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  CHECK(err(host_view(o.data(), c.B, c.T, c.HV, c.V), host_view(ht.data(), c.N(), c.HV, c.K, c.V)) == "");
  std::string e = err(tensor_view<float, 4>(o.data(), {c.B, c.T, c.HV, c.V}, {0, c.HV * c.V, c.V, 1}), host_view(ht.data(), c.N(), c.HV, c.K, c.V));
  CHECK(e.find("'o'") != std::string::npos);
  CHECK(e.find("stride 0") != std::string::npos);
  e = err(host_view(o.data(), c.B, c.T, c.HV, c.V), tensor_view<float, 4>(ht.data(), {c.N(), c.HV, c.K, c.V}, {c.HV * c.K * c.V, 0, c.V, 1}));
  CHECK(e.find("'ht'") != std::string::npos);
  // decode: every slot of the pool the same memory
  index_t const N = 2, P = 3;
  std::vector<float> x(64, 0.1f), pool(std::size_t(c.HV * c.K * c.V), 0.f), od(std::size_t(N * c.HV * c.V));
  std::vector<std::int32_t> slots{0, 2};
  auto cx = [&](index_t a, index_t b, index_t cc) { return host_view(static_cast<float const*>(x.data()), a, b, cc); };
  kda::decode_args<float> da{cx(N, c.H, c.K), cx(N, c.H, c.K), cx(N, c.HV, c.V), cx(N, c.HV, c.K),
                             host_view(static_cast<float const*>(x.data()), N, c.HV), host_view(od.data(), N, c.HV, c.V),
                             tensor_view<float, 4>(pool.data(), {P, c.HV, c.K, c.V}, {0, c.K * c.V, c.V, 1}),
                             host_view(static_cast<std::int32_t const*>(slots.data()), N)};
  CHECK_THROWS_WITH_AS(kda::decode(cpu::simd<>{}, da), doctest::Contains("state_pool"), k3::error);
  // short-conv decode: a conv-state pool with a stride-0 slot dimension
  index_t const C = 3, W = 4;
  std::vector<float> cs(std::size_t(C * (W - 1))), wt(std::size_t(C * W), 0.2f), xy(std::size_t(N * C), 0.3f), y(std::size_t(N * C));
  CHECK_THROWS_WITH_AS(kda::short_conv_decode(cpu::serial{}, kda::short_conv_decode_args<float>{
                                                                .x = host_view(static_cast<float const*>(xy.data()), N, C),
                                                                .weight = host_view(static_cast<float const*>(wt.data()), C, W),
                                                                .conv_state = tensor_view<float, 3>(cs.data(), {P, C, W - 1}, {0, W - 1, 1}),
                                                                .y = host_view(y.data(), N, C)}),
                       doctest::Contains("conv_state"), k3::error);
}

namespace {
bool broadcast_named(std::string const& e, char const* arg) {
  return e.find(std::string("argument '") + arg + "'") != std::string::npos && e.find("stride 0") != std::string::npos;
}
}  // namespace

TEST_CASE("kda pre-processing: an output with a stride-0 dimension (aliasing itself) is rejected, naming it, at every entry point") {
  index_t const B = 2, T = 3, HV = 2, K = 4, C = 3, W = 4, N = 2;
  std::vector<float> in(512), out(512);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = 0.01f * float(i % 23) - 0.1f;
  auto ci = [&](std::size_t off) { return static_cast<float const*>(in.data()) + off; };
  auto x4 = k3::host_view(ci(0), B, T, HV, K);
  auto dy4 = k3::host_view(ci(64), B, T, HV, K);
  auto A = k3::host_view(ci(128), HV);
  auto bias = k3::host_view(ci(136), HV, K);
  auto o4 = k3::host_view(out.data(), B, T, HV, K);
  // [B, T, HV, K] with the T dimension at stride 0
  tensor_view<float, 4> const b4(out.data() + 100, {B, T, HV, K}, {HV * K, 0, K, 1});
  auto run = [&](auto const& be) {
    CHECK(broadcast_named(error_of([&] { kda::l2norm(be, kda::l2norm_args<float>{.x = x4, .y = b4}); }), "y"));
    CHECK(broadcast_named(error_of([&] { kda::l2norm_backward(be, kda::l2norm_backward_args<float>{.x = x4, .d_y = dy4, .d_x = b4}); }), "d_x"));
    CHECK(broadcast_named(error_of([&] { kda::beta_sigmoid(be, kda::beta_sigmoid_args<float, 4>{.x = x4, .beta = b4}); }), "beta"));
    CHECK(broadcast_named(error_of([&] { kda::beta_sigmoid_backward(be, kda::beta_sigmoid_backward_args<float, 4>{.x = x4, .d_beta = dy4, .d_x = b4}); }),
                          "d_x"));
    CHECK(broadcast_named(error_of([&] { kda::gate_softplus(be, kda::gate_args<float>{.x = x4, .A_log = A, .dt_bias = bias, .g = b4}); }), "g"));
    CHECK(broadcast_named(error_of([&] { kda::gate_lower_bound(be, kda::gate_args<float>{.x = x4, .A_log = A, .dt_bias = bias, .g = b4}, {.lower_bound = -1.0}); }), "g"));
    CHECK(error_of([&] {
            kda::gate_softplus_backward(be, kda::gate_backward_args<float>{.x = x4, .A_log = A, .dt_bias = bias, .d_g = dy4, .d_x = o4, .d_A_log = k3::host_view(out.data() + 300, HV),
                                               .d_dt_bias = k3::host_view(out.data() + 310, HV, K)});
          }) == "");
    CHECK(broadcast_named(error_of([&] { kda::gate_softplus_backward(be, kda::gate_backward_args<float>{.x = x4, .A_log = A, .dt_bias = bias, .d_g = dy4, .d_x = b4}); }), "d_x"));
    CHECK(broadcast_named(error_of([&] {
                            kda::gate_lower_bound_backward(be, kda::gate_backward_args<float>{.x = x4, .A_log = A, .dt_bias = bias, .d_g = dy4, .d_x = o4,
                                                                  .d_A_log = tensor_view<float, 1>(out.data() + 300, {HV}, {0})},
                                                           {.lower_bound = -1.0});
                          }),
                          "d_A_log"));
    CHECK(broadcast_named(error_of([&] {
                            kda::gate_softplus_backward(be, kda::gate_backward_args<float>{.x = x4, .A_log = A, .dt_bias = bias, .d_g = dy4, .d_x = o4,
                                                               .d_A_log = k3::host_view(out.data() + 300, HV),
                                                               .d_dt_bias = tensor_view<float, 2>(out.data() + 310, {HV, K}, {0, 1})});
                          }),
                          "d_dt_bias"));
    // short convolution: prefill, backward, decode
    auto x3 = k3::host_view(ci(0), B, T, C);
    auto dy3 = k3::host_view(ci(64), B, T, C);
    auto wt = k3::host_view(ci(128), C, W);
    auto cb = k3::host_view(ci(160), C);
    auto s0 = k3::host_view(ci(200), N, C, W - 1);
    auto y3 = k3::host_view(out.data(), B, T, C);
    tensor_view<float, 3> const b3(out.data() + 100, {B, T, C}, {C, 0, 1});
    tensor_view<float, 3> const bs(out.data() + 200, {N, C, W - 1}, {0, W - 1, 1});
    CHECK(error_of([&] {
            kda::short_conv(be, kda::short_conv_args<float>{.x = x3, .weight = wt, .bias = cb, .y = y3, .initial_state = s0, .final_state = k3::host_view(out.data() + 200, N, C, W - 1)});
          }) == "");
    CHECK(broadcast_named(error_of([&] { kda::short_conv(be, kda::short_conv_args<float>{.x = x3, .weight = wt, .bias = cb, .y = b3}); }), "y"));
    CHECK(broadcast_named(error_of([&] { kda::short_conv(be, kda::short_conv_args<float>{.x = x3, .weight = wt, .bias = cb, .y = y3, .initial_state = s0, .final_state = bs}); }),
                          "final_state"));
    auto dx3 = k3::host_view(out.data(), B, T, C);
    CHECK(broadcast_named(error_of([&] { kda::short_conv_backward(be, kda::short_conv_backward_args<float>{.x = x3, .weight = wt, .bias = cb, .d_y = dy3, .d_x = b3}); }), "d_x"));
    CHECK(broadcast_named(error_of([&] {
                            kda::short_conv_backward(be, kda::short_conv_backward_args<float>{.x = x3, .weight = wt, .bias = cb, .d_y = dy3, .d_x = dx3,
                                                            .d_weight = tensor_view<float, 2>(out.data() + 300, {C, W}, {0, 1})});
                          }),
                          "d_weight"));
    CHECK(broadcast_named(error_of([&] {
                            kda::short_conv_backward(be, kda::short_conv_backward_args<float>{.x = x3, .weight = wt, .bias = cb, .d_y = dy3, .d_x = dx3,
                                                            .d_weight = k3::host_view(out.data() + 300, C, W),
                                                            .d_bias = tensor_view<float, 1>(out.data() + 330, {C}, {0})});
                          }),
                          "d_bias"));
    CHECK(broadcast_named(error_of([&] {
                            kda::short_conv_backward(be, kda::short_conv_backward_args<float>{.x = x3, .weight = wt, .bias = cb, .d_y = dy3, .d_x = dx3, .initial_state = s0,
                                                            .d_initial_state = bs});
                          }),
                          "d_initial_state"));
    std::vector<float> pool(std::size_t(N * C * (W - 1)), 0.f);
    CHECK(broadcast_named(error_of([&] {
                            kda::short_conv_decode(be, kda::short_conv_decode_args<float>{.x = k3::host_view(ci(0), N, C), .weight = wt, .bias = cb,
                                                                                          .conv_state = k3::host_view(pool.data(), N, C, W - 1),
                                                                                          .y = tensor_view<float, 2>(out.data(), {N, C}, {0, 1})});
                          }),
                          "y"));
  };
  run(cpu::serial{});
  run(cpu::threads<>(2));
}

TEST_CASE("kda pre-processing: strided outputs (padded rows, B and T swapped) give the contiguous results, every backend") {
  index_t const B = 2, T = 5, HV = 2, K = 4, C = 3, W = 4;
  std::vector<float> in(1024);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = 0.37f * std::sin(0.61f * float(i)) + 0.02f;
  auto ci = [&](std::size_t off) { return static_cast<float const*>(in.data()) + off; };
  auto x4 = k3::host_view(ci(0), B, T, HV, K);
  auto dy4 = k3::host_view(ci(100), B, T, HV, K);
  auto A = k3::host_view(ci(200), HV);
  auto bias = k3::host_view(ci(210), HV, K);
  // [e0, e1, e2, e3] stored as [e1, e0, e2, e3 + 3]
  auto swapped4 = [](std::vector<float>& m, index_t e0, index_t e1, index_t e2, index_t e3) {
    index_t const r = e3 + 3;
    m.assign(std::size_t(e0 * e1 * e2 * r), -5.f);
    return tensor_view<float, 4>(m.data(), {e0, e1, e2, e3}, {e2 * r, e0 * e2 * r, r, 1});
  };
  auto same4 = [](tensor_view<float, 4> const& v, std::vector<float> const& ref) {
    std::size_t i = 0;
    bool ok = true;
    for (index_t a = 0; a < v.extent(0); ++a)
      for (index_t b = 0; b < v.extent(1); ++b)
        for (index_t c = 0; c < v.extent(2); ++c)
          for (index_t d = 0; d < v.extent(3); ++d) ok = ok && v(a, b, c, d) == ref[i++];
    return ok;
  };
  auto run = [&](auto const& be) {
    std::vector<float> c0(std::size_t(B * T * HV * K)), m;
    auto c0v = k3::host_view(c0.data(), B, T, HV, K);
    kda::l2norm(be, kda::l2norm_args<float>{.x = x4, .y = c0v});
    auto s = swapped4(m, B, T, HV, K);
    kda::l2norm(be, kda::l2norm_args<float>{.x = x4, .y = s});
    CHECK(same4(s, c0));
    kda::gate_lower_bound(be, kda::gate_args<float>{.x = x4, .A_log = A, .dt_bias = bias, .g = c0v}, {.lower_bound = -2.0});
    s = swapped4(m, B, T, HV, K);
    kda::gate_lower_bound(be, kda::gate_args<float>{.x = x4, .A_log = A, .dt_bias = bias, .g = s}, {.lower_bound = -2.0});
    CHECK(same4(s, c0));
    std::vector<float> da0(static_cast<std::size_t>(HV)), db0(std::size_t(HV * K)), da1(std::size_t(3 * HV)), db1(std::size_t(HV * (K + 2)));
    kda::gate_softplus_backward(be, kda::gate_backward_args<float>{.x = x4, .A_log = A, .dt_bias = bias, .d_g = dy4, .d_x = c0v, .d_A_log = k3::host_view(da0.data(), HV),
                                       .d_dt_bias = k3::host_view(db0.data(), HV, K)});
    s = swapped4(m, B, T, HV, K);
    tensor_view<float, 1> da1v(da1.data(), {HV}, {3});
    tensor_view<float, 2> db1v(db1.data(), {HV, K}, {K + 2, 1});
    kda::gate_softplus_backward(be, kda::gate_backward_args<float>{.x = x4, .A_log = A, .dt_bias = bias, .d_g = dy4, .d_x = s, .d_A_log = da1v, .d_dt_bias = db1v});
    CHECK(same4(s, c0));
    for (index_t h = 0; h < HV; ++h) {
      CHECK(da1v(h) == da0[std::size_t(h)]);
      for (index_t k = 0; k < K; ++k) CHECK(db1v(h, k) == db0[std::size_t(h * K + k)]);
    }
    // short convolution: y with B and T swapped, final_state and the gradients padded
    auto x3 = k3::host_view(ci(0), B, T, C);
    auto dy3 = k3::host_view(ci(100), B, T, C);
    auto wt = k3::host_view(ci(200), C, W);
    auto cb = k3::host_view(ci(230), C);
    auto s0 = k3::host_view(ci(300), B, C, W - 1);
    std::vector<float> y0(std::size_t(B * T * C)), f0(std::size_t(B * C * (W - 1))), y1(std::size_t(B * T * (C + 1))), f1(std::size_t(B * C * W));
    kda::short_conv(be, kda::short_conv_args<float>{.x = x3, .weight = wt, .bias = cb, .y = k3::host_view(y0.data(), B, T, C), .initial_state = s0,
                           .final_state = k3::host_view(f0.data(), B, C, W - 1)});
    tensor_view<float, 3> y1v(y1.data(), {B, T, C}, {C + 1, B * (C + 1), 1}), f1v(f1.data(), {B, C, W - 1}, {C * W, W, 1});
    kda::short_conv(be, kda::short_conv_args<float>{.x = x3, .weight = wt, .bias = cb, .y = y1v, .initial_state = s0, .final_state = f1v});
    std::vector<float> dx0(y0.size()), dw0(std::size_t(C * W)), dbias0(static_cast<std::size_t>(C)), ds0(f0.size());
    kda::short_conv_backward(be, kda::short_conv_backward_args<float>{.x = x3, .weight = wt, .bias = cb, .d_y = dy3, .d_x = k3::host_view(dx0.data(), B, T, C),
                                    .d_weight = k3::host_view(dw0.data(), C, W), .d_bias = k3::host_view(dbias0.data(), C), .initial_state = s0,
                                    .d_initial_state = k3::host_view(ds0.data(), B, C, W - 1)});
    std::vector<float> dx1(y1.size()), dw1(std::size_t(C * (W + 2))), dbias1(std::size_t(2 * C)), ds1(f1.size());
    tensor_view<float, 3> dx1v(dx1.data(), {B, T, C}, {C + 1, B * (C + 1), 1}), ds1v(ds1.data(), {B, C, W - 1}, {C * W, W, 1});
    tensor_view<float, 2> dw1v(dw1.data(), {C, W}, {W + 2, 1});
    tensor_view<float, 1> dbias1v(dbias1.data(), {C}, {2});
    kda::short_conv_backward(be, kda::short_conv_backward_args<float>{.x = x3, .weight = wt, .bias = cb, .d_y = dy3, .d_x = dx1v, .d_weight = dw1v, .d_bias = dbias1v,
                                    .initial_state = s0, .d_initial_state = ds1v});
    for (index_t b = 0; b < B; ++b)
      for (index_t c = 0; c < C; ++c) {
        for (index_t t = 0; t < T; ++t) {
          CHECK(y1v(b, t, c) == y0[std::size_t((b * T + t) * C + c)]);
          CHECK(dx1v(b, t, c) == dx0[std::size_t((b * T + t) * C + c)]);
        }
        for (index_t i = 0; i < W - 1; ++i) {
          CHECK(f1v(b, c, i) == f0[std::size_t((b * C + c) * (W - 1) + i)]);
          CHECK(ds1v(b, c, i) == ds0[std::size_t((b * C + c) * (W - 1) + i)]);
        }
      }
    for (index_t c = 0; c < C; ++c) {
      CHECK(dbias1v(c) == dbias0[std::size_t(c)]);
      for (index_t j = 0; j < W; ++j) CHECK(dw1v(c, j) == dw0[std::size_t(c * W + j)]);
    }
  };
  run(cpu::serial{});
  run(cpu::simd<>{});
  run(cpu::threads<>(3));
}
