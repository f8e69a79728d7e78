// Adversarial API checks: outputs (o, ht, gradients, dh0, segment maps, applied
// states) overlapping an input or a state must be rejected with a k3::error naming both.
#include <doctest/doctest.h>

#include <array>
#include <string>
#include <vector>

#include "support/error_of.hpp"
#include "k3/dplr.hpp"

using namespace k3;

namespace {
using k3::test::error_of;

// One float buffer holding every tensor, so that views can be made to overlap on purpose.
struct arena {
  index_t B = 1, T = 5, H = 2, K = 4, V = 4;
  std::vector<float> mem;
  index_t tok() const { return B * T * H * K; }
  index_t st() const { return B * H * K * V; }
  arena() : mem(std::size_t(20 * 40 * 4 + 64), 0.1f) {
    for (std::size_t i = 0; i < mem.size(); ++i) mem[i] = 0.01f * float(i % 17) - 0.05f;
  }
  // slot i: a [B,T,H,K] (or [N,H,K,V]) view starting at element i * 40
  tensor_view<float, 4> x(index_t i) { return host_view(mem.data() + i * 40, B, T, H, K); }
  tensor_view<float, 4> s(index_t i) { return host_view(mem.data() + i * 40, B, H, K, V); }
  dplr::forward_args<float> in() { return {x(0), x(1), x(2), x(3), x(4), x(5), s(6)}; }
};

// The old grouping of outputs and gradients, kept so that each check reads as one line.
struct outs {
  tensor_view<float, 4> o = {}, ht = {};
};
struct grad_in {
  const_view<float, 4> d_o = {}, dht = {};
};
struct grads {
  tensor_view<float, 4> dq = {}, dk = {}, dv = {}, da = {}, db = {}, dgk = {}, dh0 = {};
};
dplr::forward_args<float> fa(dplr::forward_args<float> a, outs const& o) {
  a.o = o.o;
  a.ht = o.ht;
  return a;
}
dplr::backward_args<float> ba(dplr::forward_args<float> const& a, grad_in const& gi, grads const& g) {
  return {a.q, a.k, a.v, a.a, a.b, a.gk, a.h0, gi.d_o, gi.dht, g.dq, g.dk, g.dv, g.da, g.db, g.dgk, g.dh0};
}
dplr::maps_args<float> ma(dplr::forward_args<float> const& a, tensor_view<float, 4> const& M, tensor_view<float, 4> const& N) {
  return {a.q, a.k, a.v, a.a, a.b, a.gk, M, N};
}
dplr::transposed_maps_args<float> ta(dplr::forward_args<float> const& a, const_view<float, 4> const& d_o, tensor_view<float, 4> const& Mt,
                                     tensor_view<float, 4> const& G) {
  return {a.q, a.k, a.v, a.a, a.b, a.gk, d_o, Mt, G};
}
template <class C>
dplr::cp_forward_args<float, C> on(C const& comm, dplr::forward_args<float> const& a) {
  return {&comm, a.q, a.k, a.v, a.a, a.b, a.gk, a.h0, a.o, a.ht};
}
template <class C>
dplr::cp_backward_args<float, C> on(C const& comm, dplr::backward_args<float> const& a) {
  return {&comm, a.q, a.k, a.v, a.a, a.b, a.gk, a.h0, a.d_o, a.dht, a.dq, a.dk, a.dv, a.da, a.db, a.dgk, a.dh0};
}
dplr::options const rec{.mode = dplr::algorithm::recurrent};

bool names(std::string const& e, char const* a, char const* b) {
  return e.find(std::string("'") + a + "'") != std::string::npos && e.find(std::string("'") + b + "'") != std::string::npos &&
         e.find("overlap") != std::string::npos;
}
}  // namespace

TEST_CASE("dplr forward: o over h0, ht over an input are rejected (recurrent and chunked)") {
  arena A;
  auto fwd = [&](outs const& o) {
    std::string e1 = error_of([&] { dplr::forward(cpu::serial{}, fa(A.in(), o), rec); });
    std::string e2 = error_of([&] { dplr::forward(cpu::threads<>(2), fa(A.in(), o)); });
    CHECK(e1 == e2);
    return e1;
  };
  CHECK(fwd({A.x(10), A.s(11)}) == "");
  CHECK(names(fwd({A.x(6), A.s(11)}), "o", "h0"));
  CHECK(names(fwd({A.x(10), A.s(2)}), "ht", "v"));
  CHECK(names(fwd({A.x(10), A.s(5)}), "ht", "gk"));
}

TEST_CASE("dplr backward: gradients over h0 / dht, dh0 over an input are rejected") {
  arena A;
  auto bwd = [&](grads const& g) {
    grad_in gi{A.x(7), A.s(8)};
    std::string e1 = error_of([&] { dplr::backward(cpu::serial{}, ba(A.in(), gi, g), rec); });
    std::string e2 = error_of([&] { dplr::backward(cpu::simd<>{}, ba(A.in(), gi, g)); });
    CHECK(e1 == e2);
    return e1;
  };
  CHECK(bwd({A.x(10), A.x(11), A.x(12), A.x(13), A.x(14), A.x(15), A.s(16)}) == "");
  CHECK(names(bwd({A.x(6), A.x(11), A.x(12), A.x(13), A.x(14), A.x(15), A.s(16)}), "dq", "h0"));
  CHECK(names(bwd({A.x(10), A.x(11), A.x(12), A.x(13), A.x(14), A.x(8), A.s(16)}), "dgk", "dht"));
  CHECK(names(bwd({A.x(10), A.x(11), A.x(12), A.x(13), A.x(14), A.x(15), A.s(0)}), "dh0", "q"));
  CHECK(names(bwd({A.x(10), A.x(11), A.x(12), A.x(13), A.x(14), A.x(15), A.s(7)}), "dh0", "do"));
  CHECK(names(bwd({A.x(10), A.x(11), A.x(12), A.x(13), A.x(14), A.x(15), A.s(8)}), "dh0", "dht"));
  CHECK(names(bwd({A.x(10), A.x(11), A.x(12), A.x(13), A.x(14), A.x(15), A.s(6)}), "dh0", "h0"));
}

TEST_CASE("dplr segment maps and map algebra: outputs over the span's inputs are rejected") {
  arena A;
  auto in = A.in();
  in.h0 = {};
  cpu::serial const one;
  CHECK(error_of([&] { dplr::segment_maps(one, ma(in, A.s(10), A.s(11))); }) == "");
  CHECK(names(error_of([&] { dplr::segment_maps(one, ma(in, A.s(1), A.s(11))); }), "M", "k"));
  CHECK(names(error_of([&] { dplr::segment_maps(cpu::threads<>(2), ma(in, A.s(10), A.s(3))); }), "N", "a"));
  CHECK(names(error_of([&] { dplr::segment_maps_transposed(one, ta(in, A.x(7), A.s(10), A.s(7))); }), "G", "do"));
  CHECK(names(error_of([&] { dplr::segment_maps_transposed(one, ta(in, A.x(7), A.s(4), A.s(11))); }), "Mt", "b"));
  // S_out = M S_in + N with S_out over M (read again for every later column)
  CHECK(error_of([&] { dplr::apply_map(one, dplr::apply_args<float>{A.s(10), A.s(11), A.s(12), A.s(13)}); }) == "");
  CHECK(names(error_of([&] { dplr::apply_map(one, dplr::apply_args<float>{A.s(10), A.s(11), A.s(12), A.s(10)}); }), "S_out", "M"));
  CHECK(names(error_of([&] {
                dplr::apply_map(one, dplr::apply_args<float>{A.s(10), A.s(11), A.s(12), tensor_view<float, 4>(A.s(11).data_handle() + 1, A.s(11).extents())});
              }),
              "S_out", "N"));
  // in place over N: the same result as into fresh memory
  std::vector<float> fresh(std::size_t(A.st()));
  dplr::apply_map(one, dplr::apply_args<float>{A.s(10), A.s(11), A.s(12), host_view(fresh.data(), A.B, A.H, A.K, A.V)});
  dplr::apply_map(one, dplr::apply_args<float>{A.s(10), A.s(11), A.s(12), A.s(11)});
  CHECK(std::vector<float>(A.s(11).data_handle(), A.s(11).data_handle() + A.st()) == fresh);
}

TEST_CASE("dplr context parallel: h0, dht and dh0 are checked against the other arguments too") {
  arena A;
  k3::single_process comm;
  cpu::serial const one;
  grad_in gi{A.x(7), A.s(8)};
  CHECK(names(error_of([&] { dplr::forward(one, on(comm, fa(A.in(), outs{A.x(6), A.s(11)}))); }), "o", "h0"));
  CHECK(names(error_of([&] { dplr::backward(one, on(comm, ba(A.in(), gi, grads{A.x(10), A.x(11), A.x(12), A.x(13), A.x(14), A.x(15), A.s(2)}))); }),
              "dh0", "v"));
  CHECK(error_of([&] { dplr::backward(one, on(comm, ba(A.in(), gi, grads{A.x(10), A.x(11), A.x(12), A.x(13), A.x(14), A.x(15), A.s(16)}))); }) ==
        "");
}

TEST_CASE("kda_as_dplr::grads_to_kda: null or overlapping outputs are rejected") {
  index_t const B = 1, T = 3, H = 1, HV = 2, K = 4, V = 4;
  std::vector<float> buf(std::size_t(64 * 20), 0.1f);
  auto at = [&](int i) { return buf.data() + 64 * i; };
  auto c = [](float* p) { return static_cast<float const*>(p); };
  dplr::kda_inputs<float> in{host_view(c(at(0)), B, T, H, K), host_view(c(at(1)), B, T, H, K), host_view(c(at(2)), B, T, HV, V),
                       host_view(c(at(3)), B, T, HV, K), host_view(c(at(4)), B, T, HV), {}};
  dplr::kda_as_dplr<float> m(in);
  auto g = m.backward_inputs();
  g.dq = host_view(at(5), B, T, HV, K), g.dk = host_view(at(6), B, T, HV, K), g.dv = host_view(at(7), B, T, HV, V);
  g.da = host_view(at(8), B, T, HV, K), g.db = host_view(at(9), B, T, HV, K), g.dgk = host_view(at(10), B, T, HV, K);
  auto fold = [&](dplr::kda_grads<float> const& o) { return error_of([&] { m.grads_to_kda(g, o); }); };
  CHECK(fold({host_view(at(11), B, T, H, K), host_view(at(12), B, T, H, K), host_view(at(13), B, T, HV, V), host_view(at(14), B, T, HV, K),
              host_view(at(15), B, T, HV)}) == "");
  CHECK(fold({tensor_view<float, 4>(nullptr, {B, T, H, K}), host_view(at(12), B, T, H, K), host_view(at(13), B, T, HV, V),
              host_view(at(14), B, T, HV, K), host_view(at(15), B, T, HV)})
            .find("dq") != std::string::npos);
  CHECK(names(fold({host_view(at(5), B, T, H, K), host_view(at(12), B, T, H, K), host_view(at(13), B, T, HV, V), host_view(at(14), B, T, HV, K),
                    host_view(at(15), B, T, HV)}),
              "dq", "dq'"));
  CHECK(names(fold({host_view(at(11), B, T, H, K), host_view(at(12), B, T, H, K), host_view(at(13), B, T, HV, V), host_view(at(3), B, T, HV, K),
                    host_view(at(15), B, T, HV)}),
              "dg", "g"));
  CHECK(names(fold({host_view(at(11), B, T, H, K), host_view(at(12), B, T, H, K), host_view(at(13), B, T, HV, V), host_view(at(14), B, T, HV, K),
                    host_view(at(11) + 2, B, T, HV)}),
              "dq", "dbeta"));
}

namespace {
bool broadcast_named(std::string const& e, char const* arg) {
  return e.find(std::string("argument '") + arg + "'") != std::string::npos && e.find("stride 0") != std::string::npos;
}
// [e0, e1, e2, e3] over `mem` with dimension `zero` given stride 0 (the others dense).
tensor_view<float, 4> bcast4(std::vector<float>& mem, index_t e0, index_t e1, index_t e2, index_t e3, int zero) {
  index_t st[4] = {e1 * e2 * e3, e2 * e3, e3, 1};
  st[zero] = 0;
  return tensor_view<float, 4>(mem.data(), {e0, e1, e2, e3}, {st[0], st[1], st[2], st[3]});
}
// [e0, e1, e2, e3] with padding after every row and every matrix (stride 1 inside rows).
tensor_view<float, 4> padded4(std::vector<float>& mem, index_t e0, index_t e1, index_t e2, index_t e3) {
  index_t const s2 = e3 + 3, s1 = e2 * s2 + 5, s0 = e1 * s1 + 7;
  mem.assign(std::size_t(e0 * s0 + 8), -9.f);
  return tensor_view<float, 4>(mem.data(), {e0, e1, e2, e3}, {s0, s1, s2, 1});
}
std::vector<float> dense(tensor_view<float, 4> const& v) {
  std::vector<float> out;
  for (index_t a = 0; a < v.extent(0); ++a)
    for (index_t b = 0; b < v.extent(1); ++b)
      for (index_t c = 0; c < v.extent(2); ++c)
        for (index_t d = 0; d < v.extent(3); ++d) out.push_back(v(a, b, c, d));
  return out;
}
}  // namespace

TEST_CASE("dplr: an output with a stride-0 dimension (aliasing itself) is rejected, naming it, at every entry point") {
  arena A;
  std::vector<float> z(4096);
  index_t const B = A.B, T = A.T, H = A.H, K = A.K, V = A.V;
  auto tokK = [&](int zero) { return bcast4(z, B, T, H, K, zero); };
  auto st = [&](int zero) { return bcast4(z, B, H, K, V, zero); };
  // forward: o broadcast over T or H; ht over H or K
  for (int zero : {1, 2}) {
    CHECK(broadcast_named(error_of([&] { dplr::forward(cpu::serial{}, fa(A.in(), outs{tokK(zero), A.s(11)}), rec); }), "o"));
    CHECK(broadcast_named(error_of([&] { dplr::forward(cpu::threads<>(2), fa(A.in(), outs{tokK(zero), A.s(11)})); }), "o"));
    CHECK(broadcast_named(error_of([&] { dplr::forward(cpu::serial{}, fa(A.in(), outs{A.x(10), st(zero)})); }), "ht"));
    CHECK(broadcast_named(error_of([&] {
                            dplr::forward(cpu::serial{}, dplr::iplr_forward_args<float>{A.x(0), A.x(1), A.x(2), A.x(3), A.x(4), A.s(6), A.x(10), st(zero)}, rec);
                          }),
                          "ht"));
    k3::single_process const comm;
    CHECK(broadcast_named(error_of([&] { dplr::forward(cpu::serial{}, on(comm, fa(A.in(), outs{tokK(zero), A.s(11)}))); }), "o"));
  }
  // backward: each gradient and dh0
  grad_in gi{A.x(7), A.s(8)};
  k3::single_process const comm;
  for (int which = 0; which < 7; ++which) {
    CAPTURE(which);
    grads g{A.x(10), A.x(11), A.x(12), A.x(13), A.x(14), A.x(15), A.s(16)};
    tensor_view<float, 4>* slot[] = {&g.dq, &g.dk, &g.dv, &g.da, &g.db, &g.dgk, &g.dh0};
    char const* nm[] = {"dq", "dk", "dv", "da", "db", "dgk", "dh0"};
    *slot[which] = which == 6 ? st(1) : tokK(1);
    CHECK(broadcast_named(error_of([&] { dplr::backward(cpu::serial{}, ba(A.in(), gi, g), rec); }), nm[which]));
    CHECK(broadcast_named(error_of([&] { dplr::backward(cpu::threads<>(2), ba(A.in(), gi, g)); }), nm[which]));
    CHECK(broadcast_named(error_of([&] { dplr::backward(cpu::serial{}, on(comm, ba(A.in(), gi, g))); }), nm[which]));
  }
  // segment maps, their algebra, the KDA fold
  auto in = A.in();
  in.h0 = {};
  auto KK = [&](int zero) { return bcast4(z, B, H, K, K, zero); };
  cpu::serial const one;
  using compose = dplr::compose_args<float>;
  CHECK(broadcast_named(error_of([&] { dplr::segment_maps(one, ma(in, KK(2), A.s(11))); }), "M"));
  CHECK(broadcast_named(error_of([&] { dplr::segment_maps(cpu::threads<>(2), ma(in, A.s(10), st(1))); }), "N"));
  CHECK(broadcast_named(error_of([&] { dplr::segment_maps_transposed(one, ta(in, A.x(7), KK(1), A.s(11))); }), "Mt"));
  CHECK(broadcast_named(error_of([&] { dplr::segment_maps_transposed(one, ta(in, A.x(7), A.s(10), st(3))); }), "G"));
  CHECK(broadcast_named(error_of([&] { dplr::compose_maps(one, compose{A.s(10), A.s(11), A.s(12), A.s(13), KK(2), A.s(15)}); }), "M"));
  CHECK(broadcast_named(error_of([&] { dplr::compose_maps(one, compose{A.s(10), A.s(11), A.s(12), A.s(13), A.s(14), st(3)}); }), "N"));
  CHECK(broadcast_named(error_of([&] { dplr::apply_map(one, dplr::apply_args<float>{A.s(10), A.s(11), A.s(12), st(2)}); }), "S_out"));
  // compose: M and N over each other (the pair was not checked before)
  CHECK(names(error_of([&] {
                dplr::compose_maps(one, compose{A.s(10), A.s(11), A.s(12), A.s(13), A.s(14), tensor_view<float, 4>(A.s(14).data_handle() + 3, A.s(14).extents())});
              }),
              "M", "N"));
  {
    index_t const HV = 2;
    std::vector<float> buf(std::size_t(64 * 20), 0.1f);
    auto at = [&](int i) { return buf.data() + 64 * i; };
    auto c = [](float* p) { return static_cast<float const*>(p); };
    dplr::kda_inputs<float> kin{host_view(c(at(0)), B, T, 1, K), host_view(c(at(1)), B, T, 1, K), host_view(c(at(2)), B, T, HV, V),
                          host_view(c(at(3)), B, T, HV, K), host_view(c(at(4)), B, T, HV), {}};
    dplr::kda_as_dplr<float> m(kin);
    auto g = m.backward_inputs();
    g.dq = host_view(at(5), B, T, HV, K), g.dk = host_view(at(6), B, T, HV, K), g.dv = host_view(at(7), B, T, HV, V);
    g.da = host_view(at(8), B, T, HV, K), g.db = host_view(at(9), B, T, HV, K), g.dgk = host_view(at(10), B, T, HV, K);
    dplr::kda_grads<float> o{host_view(at(11), B, T, 1, K), host_view(at(12), B, T, 1, K), host_view(at(13), B, T, HV, V), host_view(at(14), B, T, HV, K),
                       host_view(at(15), B, T, HV)};
    CHECK(error_of([&] { m.grads_to_kda(g, o); }) == "");
    auto o2 = o;
    o2.dq = bcast4(z, B, T, 1, K, 1);
    CHECK(broadcast_named(error_of([&] { m.grads_to_kda(g, o2); }), "dq"));
    o2 = o;
    o2.dg = bcast4(z, B, T, HV, K, 2);
    CHECK(broadcast_named(error_of([&] { m.grads_to_kda(g, o2); }), "dg"));
    o2 = o;
    o2.dbeta = tensor_view<float, 3>(z.data(), {B, T, HV}, {T * HV, 0, 1});
    CHECK(broadcast_named(error_of([&] { m.grads_to_kda(g, o2); }), "dbeta"));
  }
}

TEST_CASE("dplr: padded (strided) outputs give the numbers of contiguous ones: forward, backward, maps") {
  arena A;
  index_t const B = A.B, T = A.T, H = A.H, K = A.K, V = A.V;
  auto run = [&](auto const& be) {
    // forward
    std::vector<float> o0(std::size_t(B * T * H * V)), h0(std::size_t(A.st())), mo, mh;
    dplr::forward(be, fa(A.in(), outs{host_view(o0.data(), B, T, H, V), host_view(h0.data(), B, H, K, V)}));
    auto o1 = padded4(mo, B, T, H, V);
    auto h1 = padded4(mh, B, H, K, V);
    dplr::forward(be, fa(A.in(), outs{o1, h1}));
    CHECK(dense(o1) == o0);
    CHECK(dense(h1) == h0);
    // backward
    grad_in gi{A.x(7), A.s(8)};
    std::vector<std::vector<float>> c(7), p(7);
    auto shape_of = [&](int i) { return i == 6 ? std::array<index_t, 4>{B, H, K, V} : std::array<index_t, 4>{B, T, H, i == 2 ? V : K}; };
    std::vector<tensor_view<float, 4>> cv, pv;
    for (int i = 0; i < 7; ++i) {
      auto e = shape_of(i);
      c[std::size_t(i)].assign(std::size_t(e[0] * e[1] * e[2] * e[3]), 0.f);
      cv.push_back(host_view(c[std::size_t(i)].data(), e[0], e[1], e[2], e[3]));
      pv.push_back(padded4(p[std::size_t(i)], e[0], e[1], e[2], e[3]));
    }
    dplr::backward(be, ba(A.in(), gi, grads{cv[0], cv[1], cv[2], cv[3], cv[4], cv[5], cv[6]}));
    dplr::backward(be, ba(A.in(), gi, grads{pv[0], pv[1], pv[2], pv[3], pv[4], pv[5], pv[6]}));
    for (int i = 0; i < 7; ++i) {
      CAPTURE(i);
      CHECK(dense(pv[std::size_t(i)]) == c[std::size_t(i)]);
    }
    // segment maps
    auto in = A.in();
    in.h0 = {};
    std::vector<float> m0(std::size_t(B * H * K * K)), n0(std::size_t(A.st())), pm, pn;
    dplr::segment_maps(be, ma(in, host_view(m0.data(), B, H, K, K), host_view(n0.data(), B, H, K, V)));
    auto m1 = padded4(pm, B, H, K, K);
    auto n1 = padded4(pn, B, H, K, V);
    dplr::segment_maps(be, ma(in, m1, n1));
    CHECK(dense(m1) == m0);
    CHECK(dense(n1) == n0);
  };
  run(cpu::serial{});
  run(cpu::threads<>(2));
}
