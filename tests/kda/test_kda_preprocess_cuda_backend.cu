// KDA's pre-processing ops on k3::cuda::stream_backend (k3/kda/cuda/preprocess_backend.cuh)
// against the same calls on the CPU's serial backend (itself tested against float64 references
// and finite differences): l2norm, beta sigmoid, both gates, short conv forward / backward /
// decode, each with float and bfloat16 storage, over odd and unit sizes, B*T = 0, varlen with
// empty sequences and conv states (in place too); the host's validation on device views (same
// k3::error), and what the CUDA backend does not serve. Runs on the SIMT host runtime in every
// build and on a GPU where nvcc is.
#include "support/device_buffer.hpp"
// (device_buffer.hpp first: its config.cuh picks the CUDA runtime)
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "support/error_of.hpp"
#include "support/metrics.hpp"
#include "support/random.hpp"
#include "k3/kda/cuda/preprocess_backend.cuh"

using namespace k3;
using namespace k3::test;

namespace {

using dev = cuda_device_space;

template <class T>
std::vector<double> to_double(std::vector<T> const& v) {
  std::vector<double> r(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) r[i] = static_cast<double>(load_as<float>(v[i]));
  return r;
}

// One tensor on both sides: the host copy for the serial backend, the device copy for the CUDA
// backend, same contents to start with.
template <class T>
struct twin {
  std::vector<T> host;
  device_buffer<T> device;
  explicit twin(std::vector<T> v) : host(std::move(v)), device(host) {}
  // Gaussian contents of the given scale, rounded to T.
  twin(std::size_t n, unsigned seed, double scale = 1.0) : twin(cast(gaussian(n, seed, scale))) {}
  // An output: NaN on both sides, so that an element left unwritten fails the comparison.
  static std::vector<T> nans(std::size_t n) { return std::vector<T>(n, store_as<T>(std::numeric_limits<float>::quiet_NaN())); }
  static std::vector<T> cast(std::vector<double> const& d) {
    std::vector<T> v(d.size());
    for (std::size_t i = 0; i < d.size(); ++i) v[i] = store_as<T>(d[i]);
    return v;
  }
  template <class... E>
  tensor_view<T, sizeof...(E)> h(E... e) {
    return tensor_view<T, sizeof...(E)>(host.data(), {index_t(e)...});
  }
  template <class... E>
  tensor_view<T, sizeof...(E), dev> d(E... e) const {
    return tensor_view<T, sizeof...(E), dev>(device.p, {index_t(e)...});
  }
  std::vector<double> host_values() const { return to_double(host); }
  std::vector<double> device_values() const { return to_double(device.get()); }
};
template <class T>
twin<T> output(std::size_t n) {
  return twin<T>(twin<T>::nans(n));
}

// Relative RMS of a storage-rounded result: float agrees to fp32 rounding; a bfloat16 element
// may round the other way where the two fp32 values straddle a rounding boundary (a few do).
template <class S>
constexpr double out_tol() {
  return std::is_same_v<S, float> ? 1e-6 : 2e-3;
}
// fp32 atomic sums on the device against the host's double sums in a fixed order.
constexpr double param_tol = 1e-5;

template <class T>
void check_close(twin<T> const& t, double tol, char const* what) {
  double const e = rel_rms(t.device_values(), t.host_values());
  INFO(std::string(what) << ": rel RMS " << e);
  CHECK(e <= tol);
}

cpu::serial const host{};

// The same mistake on both backends: the same k3::error (message and kind), naming `name`.
void check_same_error(auto&& on_host, auto&& on_device, char const* name) {
  std::string const h = error_of(on_host), d = error_of(on_device);
  INFO("host: " << h << "\ndevice: " << d);
  CHECK(!h.empty());
  CHECK(h == d);
  CHECK(h.find(std::string("'") + name + "'") != std::string::npos);
  CHECK(error_kind_of(on_host).has_value());
  CHECK(error_kind_of(on_host) == error_kind_of(on_device));
}

struct rows_case {
  index_t B, T, H, D;
};
// Odd D, D past a warp and past 128 (several lanes per row), D = 1, T = 1, B*T = 0.
std::vector<rows_case> const row_cases{{2, 5, 3, 7}, {1, 1, 2, 128}, {1, 3, 1, 130}, {1, 1, 1, 1}, {0, 4, 2, 16}, {3, 0, 2, 5}};

}  // namespace

TEST_CASE_TEMPLATE("l2norm and its backward on the CUDA backend match the serial backend", S, float, bfloat16) {
  for (rows_case const& rc : row_cases) {
    index_t const B = rc.B, T = rc.T, H = rc.H, D = rc.D;
    CAPTURE(B);
    CAPTURE(T);
    CAPTURE(D);
    std::size_t const n = static_cast<std::size_t>(B * T * H * D);
    twin<S> x(n, 1 + unsigned(D), 2.0), dy(n, 2 + unsigned(D));
    auto y = output<S>(n), dx = output<S>(n);
    kda::l2norm(host, kda::l2norm_args<S>{.x = x.h(B, T, H, D), .y = y.h(B, T, H, D)});
    kda::l2norm_backward(host, kda::l2norm_backward_args<S>{.x = x.h(B, T, H, D), .d_y = dy.h(B, T, H, D), .d_x = dx.h(B, T, H, D)});
    cuda::stream_backend be;
    kda::l2norm(be, kda::l2norm_args<S, 4, dev>{.x = x.d(B, T, H, D), .y = y.d(B, T, H, D)});
    kda::l2norm_backward(be, kda::l2norm_backward_args<S, 4, dev>{.x = x.d(B, T, H, D), .d_y = dy.d(B, T, H, D), .d_x = dx.d(B, T, H, D)});
    check_close(y, out_tol<S>(), "y");
    check_close(dx, out_tol<S>(), "d_x");
  }
  // Rank 2 (rows of a matrix), as the args' Rank parameter allows.
  twin<S> x(3 * 9, 7), dy(3 * 9, 8);
  auto y = output<S>(27), dx = output<S>(27);
  kda::l2norm(host, kda::l2norm_args<S, 2>{.x = x.h(3, 9), .y = y.h(3, 9)});
  kda::l2norm_backward(host, kda::l2norm_backward_args<S, 2>{.x = x.h(3, 9), .d_y = dy.h(3, 9), .d_x = dx.h(3, 9)});
  cuda::stream_backend be;
  kda::l2norm(be, kda::l2norm_args<S, 2, dev>{.x = x.d(3, 9), .y = y.d(3, 9)});
  kda::l2norm_backward(be, kda::l2norm_backward_args<S, 2, dev>{.x = x.d(3, 9), .d_y = dy.d(3, 9), .d_x = dx.d(3, 9)});
  check_close(y, out_tol<S>(), "y, rank 2");
  check_close(dx, out_tol<S>(), "d_x, rank 2");
}

TEST_CASE_TEMPLATE("beta sigmoid and its backward on the CUDA backend match the serial backend", S, float, bfloat16) {
  for (rows_case const& rc : row_cases)
    for (bool neg : {false, true}) {
      index_t const B = rc.B, T = rc.T, HV = rc.D;  // [B, T, HV]
      CAPTURE(B);
      CAPTURE(T);
      CAPTURE(HV);
      CAPTURE(neg);
      std::size_t const n = static_cast<std::size_t>(B * T * HV);
      twin<S> x(n, 3 + unsigned(HV), 4.0), db(n, 4 + unsigned(HV));
      auto beta = output<S>(n), dx = output<S>(n);
      kda::beta_sigmoid_options const opt{.allow_neg_eigval = neg};
      kda::beta_sigmoid(host, kda::beta_sigmoid_args<S>{.x = x.h(B, T, HV), .beta = beta.h(B, T, HV)}, opt);
      kda::beta_sigmoid_backward(host, kda::beta_sigmoid_backward_args<S>{.x = x.h(B, T, HV), .d_beta = db.h(B, T, HV), .d_x = dx.h(B, T, HV)},
                                 opt);
      cuda::stream_backend be;
      kda::beta_sigmoid(be, kda::beta_sigmoid_args<S, 3, dev>{.x = x.d(B, T, HV), .beta = beta.d(B, T, HV)}, opt);
      kda::beta_sigmoid_backward(be, kda::beta_sigmoid_backward_args<S, 3, dev>{.x = x.d(B, T, HV), .d_beta = db.d(B, T, HV), .d_x = dx.d(B, T, HV)},
                                 opt);
      check_close(beta, out_tol<S>(), "beta");
      check_close(dx, out_tol<S>(), "d_x");
    }
}

TEST_CASE_TEMPLATE("both gates and their backwards on the CUDA backend match the serial backend, parameter gradients included", S, float,
                   bfloat16) {
  struct gate_case {
    index_t B, T, HV, K;
  };
  for (gate_case const& gc : std::vector<gate_case>{{2, 3, 4, 7}, {1, 1, 1, 1}, {1, 40, 3, 33}, {0, 3, 2, 5}, {2, 2, 2, 0}})
    for (bool lower : {false, true})
      for (bool params : {false, true}) {
        index_t const B = gc.B, T = gc.T, HV = gc.HV, K = gc.K;
        CAPTURE(B);
        CAPTURE(T);
        CAPTURE(HV);
        CAPTURE(K);
        CAPTURE(lower);
        CAPTURE(params);
        std::size_t const n = static_cast<std::size_t>(B * T * HV * K), hk = static_cast<std::size_t>(HV * K);
        twin<S> x(n, 11 + unsigned(K), 2.0), dg(n, 12 + unsigned(K));
        twin<float> A(std::size_t(HV), 13, 0.5), bias(hk, 14, 0.5);
        auto g = output<S>(n), dx = output<S>(n);
        auto dA = output<float>(std::size_t(HV)), dbias = output<float>(hk);
        // Without params A_log and dt_bias stay absent; their gradients are then those at 0.
        kda::gate_args<S, float> hf{.x = x.h(B, T, HV, K), .g = g.h(B, T, HV, K)};
        kda::gate_backward_args<S, float> hb{.x = x.h(B, T, HV, K), .d_g = dg.h(B, T, HV, K), .d_x = dx.h(B, T, HV, K), .d_A_log = dA.h(HV),
                                             .d_dt_bias = dbias.h(HV, K)};
        kda::gate_args<S, float, dev> df{.x = x.d(B, T, HV, K), .g = g.d(B, T, HV, K)};
        kda::gate_backward_args<S, float, dev> db{.x = x.d(B, T, HV, K), .d_g = dg.d(B, T, HV, K), .d_x = dx.d(B, T, HV, K),
                                                  .d_A_log = dA.d(HV), .d_dt_bias = dbias.d(HV, K)};
        if (params) {
          hf.A_log = hb.A_log = A.h(HV);
          hf.dt_bias = hb.dt_bias = bias.h(HV, K);
          df.A_log = db.A_log = A.d(HV);
          df.dt_bias = db.dt_bias = bias.d(HV, K);
        }
        cuda::stream_backend be;
        if (lower) {
          kda::gate_options const opt{.lower_bound = -3.5};
          kda::gate_lower_bound(host, hf, opt);
          kda::gate_lower_bound_backward(host, hb, opt);
          kda::gate_lower_bound(be, df, opt);
          kda::gate_lower_bound_backward(be, db, opt);
        } else {
          kda::gate_softplus(host, hf);
          kda::gate_softplus_backward(host, hb);
          kda::gate_softplus(be, df);
          kda::gate_softplus_backward(be, db);
        }
        check_close(g, out_tol<S>(), "g");
        check_close(dx, out_tol<S>(), "d_x");
        check_close(dA, param_tol, "d_A_log");
        check_close(dbias, param_tol, "d_dt_bias");
      }
}

namespace {

struct conv_case {
  index_t B, T, C, W;
  std::vector<std::int64_t> cu = {};  // varlen (B = 1) when not empty
  bool bias = true, state = true, silu = true;
  index_t N() const { return cu.empty() ? B : index_t(cu.size()) - 1; }
};

std::vector<conv_case> conv_cases() {
  return {
      {.B = 2, .T = 9, .C = 5, .W = 4},                                        // odd C, states
      {.B = 1, .T = 1, .C = 3, .W = 4},                                        // T = 1: every tap reads the initial state
      {.B = 1, .T = 11, .C = 6, .W = 4, .cu = {0, 3, 3, 4, 11}},               // varlen with an empty and a one-token sequence
      {.B = 3, .T = 7, .C = 33, .W = 3, .bias = false, .state = false},        // no bias, no states
      {.B = 2, .T = 6, .C = 4, .W = 1, .silu = false},                         // W = 1 (empty states), no SiLU
      {.B = 0, .T = 5, .C = 4, .W = 4},                                        // B*T = 0
      {.B = 1, .T = 0, .C = 2, .W = 4, .cu = {0, 0}},                          // varlen, T = 0: the final state is the initial one
  };
}

}  // namespace

TEST_CASE_TEMPLATE("short conv and its backward on the CUDA backend match the serial backend: batched, varlen, states", S, float, bfloat16) {
  for (conv_case const& c : conv_cases()) {
    CAPTURE(c.B);
    CAPTURE(c.T);
    CAPTURE(c.C);
    CAPTURE(c.W);
    CAPTURE(c.cu.size());
    index_t const B = c.B, T = c.T, C = c.C, W = c.W, N = c.N();
    std::size_t const n = static_cast<std::size_t>(B * T * C), ns = static_cast<std::size_t>(N * C * (W - 1));
    twin<S> x(n, 21 + unsigned(C)), dy(n, 22 + unsigned(C));
    twin<float> weight(std::size_t(C * W), 23, 0.5), bias(std::size_t(C), 24, 0.5), init(ns, 25);
    auto y = output<S>(n), dx = output<S>(n);
    auto fin = output<float>(ns), dweight = output<float>(std::size_t(C * W)), dbias = output<float>(std::size_t(C)),
         dinit = output<float>(ns);
    kda::short_conv_options opt{.silu = c.silu};
    if (!c.cu.empty()) opt.cu_seqlens = c.cu;

    kda::short_conv_args<S, float> hf{.x = x.h(B, T, C), .weight = weight.h(C, W), .y = y.h(B, T, C), .final_state = fin.h(N, C, W - 1)};
    kda::short_conv_backward_args<S, float> hb{.x = x.h(B, T, C), .weight = weight.h(C, W), .d_y = dy.h(B, T, C), .d_x = dx.h(B, T, C),
                                               .d_weight = dweight.h(C, W), .d_bias = dbias.h(C)};
    kda::short_conv_args<S, float, dev> df{.x = x.d(B, T, C), .weight = weight.d(C, W), .y = y.d(B, T, C), .final_state = fin.d(N, C, W - 1)};
    kda::short_conv_backward_args<S, float, dev> db{.x = x.d(B, T, C), .weight = weight.d(C, W), .d_y = dy.d(B, T, C), .d_x = dx.d(B, T, C),
                                                    .d_weight = dweight.d(C, W), .d_bias = dbias.d(C)};
    if (c.bias) {
      hf.bias = hb.bias = bias.h(C);
      df.bias = db.bias = bias.d(C);
    }
    if (c.state) {
      hf.initial_state = hb.initial_state = init.h(N, C, W - 1);
      df.initial_state = db.initial_state = init.d(N, C, W - 1);
      hb.d_initial_state = dinit.h(N, C, W - 1);
      db.d_initial_state = dinit.d(N, C, W - 1);
    }
    kda::short_conv(host, hf, opt);
    kda::short_conv_backward(host, hb, opt);
    cuda::stream_backend be;
    kda::short_conv(be, df, opt);
    kda::short_conv_backward(be, db, opt);
    check_close(y, out_tol<S>(), "y");
    check_close(fin, 0.0, "final_state");  // copies of inputs: exact
    check_close(dx, out_tol<S>(), "d_x");
    check_close(dweight, param_tol, "d_weight");
    check_close(dbias, param_tol, "d_bias");
    if (c.state) check_close(dinit, param_tol, "d_initial_state");

    // final_state = initial_state itself (the in-place update) serves on both backends.
    if (c.state) {
      auto y2 = output<S>(n);
      twin<float> pool(init.host);
      hf.y = y2.h(B, T, C);
      hf.initial_state = pool.h(N, C, W - 1);
      hf.final_state = pool.h(N, C, W - 1);
      df.y = y2.d(B, T, C);
      df.initial_state = pool.d(N, C, W - 1);
      df.final_state = pool.d(N, C, W - 1);
      kda::short_conv(host, hf, opt);
      kda::short_conv(be, df, opt);
      check_close(y2, out_tol<S>(), "y, in place");
      check_close(pool, 0.0, "state, in place");
      CHECK(pool.host == fin.host);
    }
  }
}

TEST_CASE_TEMPLATE("short conv decode on the CUDA backend matches the serial backend: int32, int64 and no slots", S, float, bfloat16) {
  index_t const N = 5, P = 7, C = 9, W = 4;
  std::vector<std::int64_t> const slots{4, 1, 0, 6, 2};
  twin<S> x(std::size_t(N * C), 31);
  twin<float> weight(std::size_t(C * W), 32, 0.5), bias(std::size_t(C), 33, 0.5);
  std::vector<float> const pool0 = twin<float>::cast(gaussian(std::size_t(P * C * (W - 1)), 34));
  twin<std::int64_t> s64(slots);
  twin<std::int32_t> s32(std::vector<std::int32_t>(slots.begin(), slots.end()));
  for (int form : {0, 1, 2}) {  // slots64, slots32, none
    CAPTURE(form);
    twin<float> pool(pool0);
    auto y = output<S>(std::size_t(N * C));
    kda::short_conv_decode_args<S, float> h{.x = x.h(N, C), .weight = weight.h(C, W), .bias = bias.h(C), .conv_state = pool.h(P, C, W - 1),
                                            .y = y.h(N, C)};
    kda::short_conv_decode_args<S, float, dev> d{.x = x.d(N, C), .weight = weight.d(C, W), .bias = bias.d(C),
                                                 .conv_state = pool.d(P, C, W - 1), .y = y.d(N, C)};
    if (form == 0) {
      h.slots64 = s64.h(N);
      d.slots64 = s64.d(N);
    } else if (form == 1) {
      h.slots32 = s32.h(N);
      d.slots32 = s32.d(N);
    }
    kda::short_conv_decode(host, h);
    cuda::stream_backend be;
    kda::short_conv_decode(be, d);
    check_close(y, out_tol<S>(), "y");
    check_close(pool, 0.0, "conv_state");  // shifted copies of inputs: exact
  }
  // N = 0: nothing to do on either backend.
  twin<float> pool(pool0);
  auto y0 = output<S>(0);
  kda::short_conv_decode(cuda::stream_backend{}, kda::short_conv_decode_args<S, float, dev>{.x = x.d(0, C), .weight = weight.d(C, W),
                                                                                           .conv_state = pool.d(P, C, W - 1), .y = y0.d(0, C)});
  CHECK(pool.device_values() == pool.host_values());
}

TEST_CASE("pre-processing ops on the CUDA backend: the serial backend's checks, the same k3::error") {
  cuda::stream_backend be;
  twin<float> x(2 * 3 * 2 * 8, 41), w(8 * 4, 42);
  auto y = output<float>(2 * 3 * 2 * 8);
  // y of another shape.
  check_same_error([&] { kda::l2norm(host, kda::l2norm_args<float>{.x = x.h(2, 3, 2, 8), .y = y.h(2, 3, 2, 7)}); },
                   [&] { kda::l2norm(be, kda::l2norm_args<float, 4, dev>{.x = x.d(2, 3, 2, 8), .y = y.d(2, 3, 2, 7)}); }, "y");
  // beta over x.
  check_same_error([&] { kda::beta_sigmoid(host, kda::beta_sigmoid_args<float>{.x = x.h(2, 3, 8), .beta = x.h(2, 3, 8)}); },
                   [&] { kda::beta_sigmoid(be, kda::beta_sigmoid_args<float, 3, dev>{.x = x.d(2, 3, 8), .beta = x.d(2, 3, 8)}); }, "beta");
  // A lower bound outside [-5, 0).
  check_same_error([&] { kda::gate_lower_bound(host, kda::gate_args<float>{.x = x.h(2, 3, 2, 8), .g = y.h(2, 3, 2, 8)}, {.lower_bound = 0.5}); },
                   [&] {
                     kda::gate_lower_bound(be, kda::gate_args<float, float, dev>{.x = x.d(2, 3, 2, 8), .g = y.d(2, 3, 2, 8)}, {.lower_bound = 0.5});
                   },
                   "lower_bound");
  // dt_bias of the wrong shape.
  check_same_error(
      [&] { kda::gate_softplus(host, kda::gate_args<float>{.x = x.h(2, 3, 2, 8), .dt_bias = w.h(2, 7), .g = y.h(2, 3, 2, 8)}); },
      [&] { kda::gate_softplus(be, kda::gate_args<float, float, dev>{.x = x.d(2, 3, 2, 8), .dt_bias = w.d(2, 7), .g = y.d(2, 3, 2, 8)}); },
      "dt_bias");
  // cu_seqlens that do not end at T.
  std::vector<std::int64_t> const cu{0, 2, 5};
  check_same_error(
      [&] {
        kda::short_conv(host, kda::short_conv_args<float>{.x = x.h(1, 6, 8), .weight = w.h(8, 4), .y = y.h(1, 6, 8)}, {.cu_seqlens = cu});
      },
      [&] {
        kda::short_conv(be, kda::short_conv_args<float, float, dev>{.x = x.d(1, 6, 8), .weight = w.d(8, 4), .y = y.d(1, 6, 8)},
                        {.cu_seqlens = cu});
      },
      "cu_seqlens");
  // d_initial_state without the initial state.
  twin<float> st(2 * 8 * 3, 43);
  check_same_error(
      [&] {
        kda::short_conv_backward(host, kda::short_conv_backward_args<float>{.x = x.h(2, 3, 8), .weight = w.h(8, 4), .d_y = x.h(2, 3, 8),
                                                                             .d_x = y.h(2, 3, 8), .d_initial_state = st.h(2, 8, 3)});
      },
      [&] {
        kda::short_conv_backward(be, kda::short_conv_backward_args<float, float, dev>{.x = x.d(2, 3, 8), .weight = w.d(8, 4), .d_y = x.d(2, 3, 8),
                                                                                     .d_x = y.d(2, 3, 8), .d_initial_state = st.d(2, 8, 3)});
      },
      "d_initial_state");
  // A slot used twice, read back from the device to be checked.
  twin<std::int32_t> twice(std::vector<std::int32_t>{1, 0, 1});
  check_same_error(
      [&] {
        kda::short_conv_decode(host, kda::short_conv_decode_args<float>{.x = x.h(3, 8), .weight = w.h(8, 4), .conv_state = st.h(2, 8, 3),
                                                                         .y = y.h(3, 8), .slots32 = twice.h(3)});
      },
      [&] {
        kda::short_conv_decode(be, kda::short_conv_decode_args<float, float, dev>{.x = x.d(3, 8), .weight = w.d(8, 4), .conv_state = st.d(2, 8, 3),
                                                                                 .y = y.d(3, 8), .slots32 = twice.d(3)});
      },
      "slots32");
}

TEST_CASE("pre-processing ops on the CUDA backend: what it does not serve is an unsupported k3::error naming the argument") {
  cuda::stream_backend be;
  twin<float> x(4 * 16, 51), w(16 * 4, 52);
  auto y = output<float>(4 * 16);
  auto unsupported_naming = [](char const* name, auto&& call) {
    CHECK(error_kind_of(call) == error_kind::unsupported);
    CHECK(error_of(call).find(std::string("'") + name + "'") != std::string::npos);
  };
  // A strided view (every other row of x): the launchers read contiguous rows.
  unsupported_naming("x", [&] {
    kda::l2norm(be, kda::l2norm_args<float, 2, dev>{.x = tensor_view<float const, 2, dev>(x.device.p, {2, 16}, {32, 1}), .y = y.d(2, 16)});
  });
  // Double storage.
  twin<double> xd(4 * 16, 53);
  auto yd = output<double>(4 * 16);
  unsupported_naming("x", [&] { kda::beta_sigmoid(be, kda::beta_sigmoid_args<double, 1, dev>{.x = xd.d(64), .beta = yd.d(64)}); });
  // bfloat16 parameters (the launchers take float weights and states).
  twin<bfloat16> wb(16 * 4, 54);
  unsupported_naming("weight", [&] {
    kda::short_conv(be, kda::short_conv_args<float, bfloat16, dev>{.x = x.d(1, 4, 16), .weight = wb.d(16, 4), .y = y.d(1, 4, 16)});
  });
  unsupported_naming("A_log", [&] {
    kda::gate_softplus(be, kda::gate_args<float, bfloat16, dev>{.x = x.d(1, 4, 1, 16), .A_log = wb.d(1), .g = y.d(1, 4, 1, 16)});
  });
  // ... but a gate without parameters never reads P: it serves.
  kda::gate_softplus(be, kda::gate_args<float, bfloat16, dev>{.x = x.d(1, 4, 1, 16), .g = y.d(1, 4, 1, 16)});
  auto yh = output<float>(4 * 16);
  kda::gate_softplus(host, kda::gate_args<float, bfloat16>{.x = x.h(1, 4, 1, 16), .g = yh.h(1, 4, 1, 16)});
  CHECK(rel_rms(y.device_values(), yh.host_values()) <= 1e-6);
}
