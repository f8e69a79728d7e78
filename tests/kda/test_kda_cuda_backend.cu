// k3::kda::forward / backward on k3::cuda::stream_backend (k3/kda/cuda/backend.cuh) against the
// same calls on the CPU backend: float and bfloat16 storage, T not a multiple of the chunk,
// T = 1, grouped value heads, varlen with empty sequences, h0 / ht / dht, the lower-bounded gate;
// the CPU's validation on device views (same messages), what the CUDA backend does not serve,
// and empty states. Runs on the SIMT host runtime in every build and on a GPU where nvcc is.
#include "support/device_buffer.hpp"
// (device_buffer.hpp first: its config.cuh picks the CUDA runtime)
#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "support/error_of.hpp"
#include "support/metrics.hpp"
#include "k3/kda.hpp"
#include "k3/kda/cuda/backend.cuh"
#include "kda/kda_fixture.hpp"

using namespace k3;
using namespace k3::test;

namespace {

using dev = cuda_device_space;

template <class T, std::size_t R>
tensor_view<T const, R, dev> cview(device_buffer<T> const& b, k3::array<index_t, R> e) {
  return tensor_view<T const, R, dev>(b.p, e);
}
template <class T, std::size_t R>
tensor_view<T, R, dev> mview(device_buffer<T> const& b, k3::array<index_t, R> e) {
  return tensor_view<T, R, dev>(b.p, e);
}
// An optional input: absent when the case has none.
template <class T, std::size_t R>
tensor_view<T const, R, dev> optional_view(device_buffer<T> const& b, k3::array<index_t, R> e) {
  return b.n ? cview(b, e) : tensor_view<T const, R, dev>{};
}

// The inputs of a typed_data case on the device, and the outputs of a forward and a backward.
template <class In>
struct on_device {
  kda_case c;
  device_buffer<In> q, k, v, g, beta, d_o, o, dq, dk, dv, dg, dbeta;
  device_buffer<float> h0, dht, ht, dh0;
  explicit on_device(typed_data<In, float> const& d)
      : c(d.c), q(d.q), k(d.k), v(d.v), g(d.g), beta(d.beta), d_o(d.d_o), o(std::size_t(c.B * c.T * c.HV * c.V), 0xFF),
        dq(d.q.size(), 0xFF), dk(d.k.size(), 0xFF), dv(d.v.size(), 0xFF), dg(d.g.size(), 0xFF), dbeta(d.beta.size(), 0xFF), h0(d.h0),
        dht(d.dht), ht(std::size_t(c.N() * c.HV * c.K * c.V), 0xFF), dh0(std::size_t(c.N() * c.HV * c.K * c.V), 0xFF) {}
  k3::array<index_t, 4> qk() const { return {c.B, c.T, c.H, c.K}; }
  k3::array<index_t, 4> vo() const { return {c.B, c.T, c.HV, c.V}; }
  k3::array<index_t, 4> gk() const { return {c.B, c.T, c.HV, c.K}; }
  k3::array<index_t, 4> st() const { return {c.N(), c.HV, c.K, c.V}; }
  kda::forward_args<In, float, dev> fwd() const {
    kda::forward_args<In, float, dev> a;
    a.q = cview(q, qk());
    a.k = cview(k, qk());
    a.v = cview(v, vo());
    a.g = cview(g, gk());
    a.beta = cview(beta, k3::array<index_t, 3>{c.B, c.T, c.HV});
    a.o = mview(o, vo());
    a.h0 = optional_view(h0, st());
    a.ht = mview(ht, st());
    return a;
  }
  kda::backward_args<In, float, dev> bwd() const {
    kda::backward_args<In, float, dev> a;
    a.q = cview(q, qk());
    a.k = cview(k, qk());
    a.v = cview(v, vo());
    a.g = cview(g, gk());
    a.beta = cview(beta, k3::array<index_t, 3>{c.B, c.T, c.HV});
    a.h0 = optional_view(h0, st());
    a.d_o = cview(d_o, vo());
    a.dht = optional_view(dht, st());
    a.dq = mview(dq, qk());
    a.dk = mview(dk, qk());
    a.dv = mview(dv, vo());
    a.dg = mview(dg, gk());
    a.dbeta = mview(dbeta, k3::array<index_t, 3>{c.B, c.T, c.HV});
    a.dh0 = mview(dh0, st());
    return a;
  }
};

struct tolerances {
  double o, ht, dqkv, dgb;
};

// The CUDA backend against the CPU's chunked form on the same (storage-rounded) inputs.
template <class In>
void check_against_cpu(kda_case const& c, tolerances tol) {
  CAPTURE(c.B);
  CAPTURE(c.T);
  CAPTURE(c.HV);
  CAPTURE(c.K);
  CAPTURE(c.V);
  CAPTURE(c.cu.size());
  typed_data<In, float> d(make_data(c));
  auto const ref_f = run_forward(d, kda::algorithm::chunk);
  auto const ref_b = run_backward(d, kda::algorithm::chunk);
  on_device<In> x(d);
  cuda::stream_backend be;
  kda::forward(be, x.fwd(), d.opts(kda::algorithm::automatic));
  kda::backward(be, x.bwd(), d.opts(kda::algorithm::chunk));
  CHECK(rel_rms(to_double(x.o.get()), ref_f.o) < tol.o);
  CHECK(rel_rms(to_double(x.ht.get()), ref_f.ht) < tol.ht);
  CHECK(rel_rms(to_double(x.dq.get()), ref_b.dq) < tol.dqkv);
  CHECK(rel_rms(to_double(x.dk.get()), ref_b.dk) < tol.dqkv);
  CHECK(rel_rms(to_double(x.dv.get()), ref_b.dv) < tol.dqkv);
  CHECK(rel_rms(to_double(x.dh0.get()), ref_b.dh0) < tol.dqkv);
  CHECK(rel_rms(to_double(x.dg.get()), ref_b.dg) < tol.dgb);
  CHECK(rel_rms(to_double(x.dbeta.get()), ref_b.dbeta) < tol.dgb);
}

std::vector<kda_case> cases() {
  return {
      {.B = 2, .T = 70, .H = 1, .HV = 2, .K = 16, .V = 24, .seed = 3},                                        // T past a chunk, GVA
      {.B = 1, .T = 1, .H = 2, .HV = 2, .K = 8, .V = 8, .seed = 4},                                           // T = 1
      {.B = 1, .T = 150, .H = 1, .HV = 1, .K = 32, .V = 40, .cu = {0, 0, 64, 64, 150}, .seed = 5},            // varlen, empty sequences
      {.B = 1, .T = 90, .H = 1, .HV = 3, .K = 20, .V = 33, .h0 = false, .dht = false, .gate = gate_kind::lower_bound, .seed = 6},
  };
}

}  // namespace

TEST_CASE("kda on the CUDA backend matches the CPU backend, float storage") {
  for (auto const& c : cases()) check_against_cpu<float>(c, {2e-5, 2e-5, 2e-4, 2e-4});
}

// fla's bfloat16 tolerances: o and ht 0.005, dq dk dv dh0 0.008, dg dbeta 0.02 relative RMS.
TEST_CASE("kda on the CUDA backend matches the CPU backend, bfloat16 storage") {
  for (auto const& c : cases()) check_against_cpu<bfloat16>(c, {0.005, 0.005, 0.008, 0.02});
}

TEST_CASE("kda on the CUDA backend: the CPU backend's checks, and what it does not serve") {
  kda_case const c{.B = 1, .T = 20, .H = 1, .HV = 1, .K = 8, .V = 8, .seed = 7};
  typed_data<float, float> d(make_data(c));
  on_device<float> x(d);
  cuda::stream_backend be;
  kda::options const opt = d.opts(kda::algorithm::automatic);

  auto f = x.fwd();
  f.k = tensor_view<float const, 4, dev>(x.k.p, {1, 20, 1, 7});
  kda::forward_args<float> hf;  // the same mistake on the host: the same message
  std::vector<float> ho(160), hq(d.q.begin(), d.q.end());
  hf.q = host_view(static_cast<float const*>(hq.data()), 1, 20, 1, 8);
  hf.k = host_view(static_cast<float const*>(hq.data()), 1, 20, 1, 7);
  hf.v = hf.q;
  hf.g = hf.q;
  hf.beta = host_view(static_cast<float const*>(d.beta.data()), 1, 20, 1);
  hf.o = host_view(ho.data(), 1, 20, 1, 8);
  std::string const on_device_msg = error_of([&] { kda::forward(be, f, opt); });
  CHECK(on_device_msg.find("argument 'k': expected shape [1, 20, 1, 8]") != std::string::npos);
  CHECK(on_device_msg == error_of([&] { kda::forward(cpu::serial{}, hf, opt); }));

  f = x.fwd();
  f.o = tensor_view<float, 4, dev>(const_cast<float*>(x.v.p), {1, 20, 1, 8});  // o over v
  CHECK(error_of([&] { kda::forward(be, f, opt); }).find("overlap") != std::string::npos);

  kda::options rec = opt;
  rec.mode = kda::algorithm::recurrent;
  CHECK(error_kind_of([&] { kda::forward(be, x.fwd(), rec); }) == error_kind::unsupported);
  kda::options neg = opt;
  neg.scale = -0.5;
  CHECK(error_kind_of([&] { kda::forward(be, x.fwd(), neg); }) == error_kind::unsupported);
  auto fs = x.fwd();
  auto const sh = kda::saved_shape(fs, opt);
  device_buffer<float> saved(std::size_t(sh[0] * sh[1] * sh[2]));
  fs.saved = tensor_view<float, 3, dev>(saved.p, {sh[0], sh[1], sh[2]});
  CHECK(error_kind_of([&] { kda::forward(be, fs, opt); }) == error_kind::unsupported);

  // K above the kernels' limit: unsupported, before any launch.
  kda_case wide = c;
  wide.K = 136;
  typed_data<float, float> dw(make_data(wide));
  on_device<float> xw(dw);
  CHECK(error_kind_of([&] { kda::forward(be, xw.fwd(), dw.opts(kda::algorithm::automatic)); }) == error_kind::unsupported);

  // A strided device view: unsupported (the kernels read contiguous rows).
  auto fstride = x.fwd();
  fstride.q = tensor_view<float const, 4, dev>(x.q.p, {1, 10, 1, 8}, {160, 16, 8, 1});
  fstride.k = fstride.q;
  fstride.v = fstride.q;
  fstride.g = fstride.q;
  fstride.beta = tensor_view<float const, 3, dev>(x.beta.p, {1, 10, 1});
  fstride.o = tensor_view<float, 4, dev>(x.o.p, {1, 10, 1, 8});
  fstride.h0 = {};
  fstride.ht = {};
  CHECK(error_kind_of([&] { kda::forward(be, fstride, opt); }) == error_kind::unsupported);
}

TEST_CASE("kda on the CUDA backend: an empty state gives o = 0 and zero gradients") {
  kda_case const c{.B = 1, .T = 9, .H = 1, .HV = 1, .K = 0, .V = 5, .seed = 8};
  typed_data<float, float> d(make_data(c));
  on_device<float> x(d);
  cuda::stream_backend be;
  kda::forward(be, x.fwd(), d.opts(kda::algorithm::automatic));
  kda::backward(be, x.bwd(), d.opts(kda::algorithm::automatic));
  for (float e : x.o.get()) CHECK(e == 0.0f);
  for (float e : x.dv.get()) CHECK(e == 0.0f);
  for (float e : x.dbeta.get()) CHECK(e == 0.0f);
}

TEST_CASE_TEMPLATE("kda decode on the CUDA backend matches the CPU decode: int32 and int64 slots, padding, bad slots", In, float, bfloat16) {
  index_t const N = 5, P = 7, H = 1, HV = 2, K = 12, V = 10;
  std::mt19937_64 rng(11);
  std::normal_distribution<double> nd(0.0, 0.3);
  auto fill = [&](std::size_t n, double shift = 0.0) {
    std::vector<double> x(n);
    for (auto& e : x) e = nd(rng) + shift;
    return x;
  };
  std::vector<In> const q = cast_to<In>(fill(N * H * K)), k = cast_to<In>(fill(N * H * K)), v = cast_to<In>(fill(N * HV * V)),
                        g = cast_to<In>(fill(N * HV * K, -0.5)), beta = cast_to<In>(std::vector<double>(N * HV, 0.6));
  std::vector<float> const pool0 = cast_to<float>(fill(P * HV * K * V));
  std::vector<std::int64_t> const slots{4, -1, 0, 6, 2};  // entry 1 is padding
  auto run_cpu = [&] {
    std::vector<float> pool = pool0;
    std::vector<In> o(std::size_t(N * HV * V), store_as<In>(-3.0));
    kda::decode_args<In, float> a;
    a.q = host_view(q.data(), N, H, K);
    a.k = host_view(k.data(), N, H, K);
    a.v = host_view(v.data(), N, HV, V);
    a.g = host_view(g.data(), N, HV, K);
    a.beta = host_view(beta.data(), N, HV);
    a.o = host_view(o.data(), N, HV, V);
    a.state_pool = host_view(pool.data(), P, HV, K, V);
    a.slots64 = host_view(slots.data(), N);
    kda::decode(cpu::serial{}, a);
    return std::pair{to_double(o), to_double(pool)};
  };
  auto const ref = run_cpu();
  std::vector<double> const& o_ref = ref.first;
  std::vector<double> const& pool_ref = ref.second;
  for (bool narrow_slots : {false, true}) {
    CAPTURE(narrow_slots);
    device_buffer<In> dq(q), dk(k), dv(v), dg(g), db(beta), dout(std::vector<In>(std::size_t(N * HV * V), store_as<In>(-3.0)));
    device_buffer<float> dpool(pool0);
    device_buffer<std::int64_t> s64(slots);
    device_buffer<std::int32_t> s32(std::vector<std::int32_t>(slots.begin(), slots.end()));
    kda::decode_args<In, float, dev> a;
    a.q = cview(dq, k3::array<index_t, 3>{N, H, K});
    a.k = cview(dk, k3::array<index_t, 3>{N, H, K});
    a.v = cview(dv, k3::array<index_t, 3>{N, HV, V});
    a.g = cview(dg, k3::array<index_t, 3>{N, HV, K});
    a.beta = cview(db, k3::array<index_t, 2>{N, HV});
    a.o = mview(dout, k3::array<index_t, 3>{N, HV, V});
    a.state_pool = mview(dpool, k3::array<index_t, 4>{P, HV, K, V});
    if (narrow_slots)
      a.slots32 = cview(s32, k3::array<index_t, 1>{N});
    else
      a.slots64 = cview(s64, k3::array<index_t, 1>{N});
    cuda::stream_backend be;
    kda::decode(be, a);
    double const tol = std::is_same_v<In, float> ? 1e-5 : 0.005;
    auto const o = to_double(dout.get());
    CHECK(rel_rms(o, o_ref) < tol);
    for (index_t j = 0; j < HV * V; ++j) CHECK(o[std::size_t(HV * V + j)] == -3.0);  // padding: o untouched
    CHECK(rel_rms(to_double(dpool.get()), pool_ref) < 1e-5);

    device_buffer<std::int64_t> twice(std::vector<std::int64_t>{4, -1, 0, 4, 2});
    a.slots32 = {};
    a.slots64 = cview(twice, k3::array<index_t, 1>{N});
    CHECK(error_of([&] { kda::decode(be, a); }).find("appears twice") != std::string::npos);
  }
}
