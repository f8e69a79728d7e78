// Tests of the short causal depthwise convolution + SiLU (k3/kda/preprocess/conv.hpp):
// forward against a float64 reference built per sequence from a padded copy, varlen without
// leakage, backward (dx, dweight, dbias, d_initial_state) against finite differences, decode
// after prefill equal to the full convolution, state pools addressed by slots, serial vs
// threads, bfloat16 storage, bad input.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "k3/backend/cpu/simd.hpp"
#include "k3/kda/preprocess.hpp"

#include "kda/preprocess_checks.hpp"
#include "support/error_of.hpp"

using k3::bfloat16;
using k3::index_t;
using namespace k3::test;

namespace {


struct seq {
  index_t b, start, len;
};

std::vector<seq> batched(index_t B, index_t T) {
  std::vector<seq> s;
  for (index_t b = 0; b < B; ++b) s.push_back({b, 0, T});
  return s;
}
std::vector<seq> from_cu(std::vector<std::int64_t> const& cu) {
  std::vector<seq> s;
  for (std::size_t i = 0; i + 1 < cu.size(); ++i) s.push_back({0, cu[i], cu[i + 1] - cu[i]});
  return s;
}

struct conv_out {
  std::vector<double> y, final_state;
};

// float64 reference: per sequence and channel, a padded copy (initial state or zeros, then
// the inputs), convolved directly.
conv_out ref_conv(std::vector<double> const& x, index_t B, index_t T, index_t C, std::vector<double> const& w, index_t W,
                  std::vector<double> const& bias, std::vector<seq> const& seqs, std::vector<double> const& init, bool silu) {
  conv_out out;
  out.y.assign(static_cast<std::size_t>(B * T * C), 0.0);
  out.final_state.assign(seqs.size() * static_cast<std::size_t>(C * (W - 1)), 0.0);
  for (std::size_t n = 0; n < seqs.size(); ++n) {
    seq const& s = seqs[n];
    for (index_t c = 0; c < C; ++c) {
      std::vector<double> ext(static_cast<std::size_t>(W - 1 + s.len), 0.0);
      for (index_t i = 0; i < W - 1; ++i)
        ext[static_cast<std::size_t>(i)] = init.empty() ? 0.0 : init[(n * C + c) * (W - 1) + i];
      for (index_t i = 0; i < s.len; ++i) ext[static_cast<std::size_t>(W - 1 + i)] = x[static_cast<std::size_t>((s.b * T + s.start + i) * C + c)];
      for (index_t i = 0; i < s.len; ++i) {
        double z = bias.empty() ? 0.0 : bias[static_cast<std::size_t>(c)];
        for (index_t j = 0; j < W; ++j) z += w[static_cast<std::size_t>(c * W + j)] * ext[static_cast<std::size_t>(i + j)];
        out.y[static_cast<std::size_t>((s.b * T + s.start + i) * C + c)] = silu ? z / (1.0 + std::exp(-z)) : z;
      }
      for (index_t i = 0; i < W - 1; ++i)
        out.final_state[(n * C + c) * (W - 1) + i] = ext[static_cast<std::size_t>(s.len + i)];
    }
  }
  return out;
}

double dot(std::vector<double> const& a, std::vector<double> const& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

k3::cpu::serial serial;

}  // namespace

TEST_CASE_TEMPLATE("short conv forward matches the float64 reference (batched and varlen)", S, double, float, bfloat16) {
  index_t const C = 12, W = 4;
  auto xd_w = randn(static_cast<std::size_t>(C * W), 2, 0.6);
  auto w = cast<S>(xd_w);
  auto bias = cast<S>(randn(C, 3, 0.3));
  double const tol = std::is_same_v<S, double> ? 1e-14 : std::is_same_v<S, float> ? 2e-6 : 8e-3;
  double const atol = std::is_same_v<S, double> ? 1e-14 : std::is_same_v<S, float> ? 1e-6 : 2e-3;
  for (bool silu : {true, false})
    for (bool with_init : {false, true}) {
      CAPTURE(silu);
      CAPTURE(with_init);
      // batched: B = 3, T = 10 (T shorter and longer than the window covered)
      {
        index_t const B = 3, T = 10;
        auto x = cast<S>(randn(static_cast<std::size_t>(B * T * C), 4));
        auto init = cast<S>(randn(static_cast<std::size_t>(B * C * (W - 1)), 5));
        std::vector<S> y(x.size()), fs(init.size());
        auto iv = k3::host_view(init.data(), B, C, W - 1);
        auto fv = k3::host_view(fs.data(), B, C, W - 1);
        k3::kda::short_conv(serial,
                            k3::kda::short_conv_args<S>{.x = k3::host_view(x.data(), B, T, C), .weight = k3::host_view(w.data(), C, W),
                                                        .bias = k3::host_view(bias.data(), C), .y = k3::host_view(y.data(), B, T, C),
                                                        .initial_state = with_init ? iv : decltype(iv){}, .final_state = fv},
                            {.silu = silu});
        auto ref = ref_conv(widen(x), B, T, C, widen(w), W, widen(bias), batched(B, T), with_init ? widen(init) : std::vector<double>{},
                            silu);
        check_close(widen(y), ref.y, tol, atol, "y (batched)");
        check_close(widen(fs), ref.final_state, tol, atol, "final state (batched)");
      }
      // varlen: empty, length 1, 2, 3 (shorter than the window), 4, long
      {
        std::vector<std::int64_t> cu64 = {0, 0, 1, 3, 6, 6, 10, 29};
        std::vector<std::int32_t> cu32(cu64.begin(), cu64.end());
        index_t const T = cu64.back(), N = static_cast<index_t>(cu64.size()) - 1;
        auto x = cast<S>(randn(static_cast<std::size_t>(T * C), 6));
        auto init = cast<S>(randn(static_cast<std::size_t>(N * C * (W - 1)), 7));
        std::vector<S> y(x.size()), y32(x.size()), fs(init.size());
        auto xv = k3::host_view(x.data(), 1, T, C);
        auto fv = k3::host_view(fs.data(), N, C, W - 1);
        k3::tensor_view<S const, 3> const iv = with_init ? k3::host_view(init.data(), N, C, W - 1) : k3::tensor_view<S, 3>{};
        k3::kda::short_conv(serial,
                            k3::kda::short_conv_args<S>{.x = xv, .weight = k3::host_view(w.data(), C, W), .y = k3::host_view(y.data(), 1, T, C),
                                                        .initial_state = iv, .final_state = fv},
                            {.cu_seqlens = k3::host_view(cu64.data(), N + 1), .silu = silu});
        k3::kda::short_conv(serial,
                            k3::kda::short_conv_args<S>{.x = xv, .weight = k3::host_view(w.data(), C, W), .y = k3::host_view(y32.data(), 1, T, C),
                                                        .initial_state = iv},
                            {.cu_seqlens = k3::host_view(cu32.data(), N + 1), .silu = silu});
        CHECK(widen(y) == widen(y32));  // int32 and int64 cu_seqlens agree
        auto ref = ref_conv(widen(x), 1, T, C, widen(w), W, {}, from_cu(cu64), with_init ? widen(init) : std::vector<double>{}, silu);
        check_close(widen(y), ref.y, tol, atol, "y (varlen)");
        check_close(widen(fs), ref.final_state, tol, atol, "final state (varlen)");
      }
    }
}

TEST_CASE("varlen: nothing leaks across sequence boundaries") {
  index_t const C = 5, W = 4;
  std::vector<std::int64_t> cu = {0, 7, 9, 20};
  index_t const T = 20;
  auto x = randn(static_cast<std::size_t>(T * C), 11);
  auto w = randn(static_cast<std::size_t>(C * W), 12);
  std::vector<double> y1(x.size()), y2(x.size());
  auto run = [&](std::vector<double> const& xin, std::vector<double>& y) {
    k3::kda::short_conv(serial,
                        k3::kda::short_conv_args<double>{.x = k3::host_view(xin.data(), 1, T, C), .weight = k3::host_view(w.data(), C, W),
                                                         .y = k3::host_view(y.data(), 1, T, C)},
                        {.cu_seqlens = k3::host_view(cu.data(), 4)});
  };
  run(x, y1);
  auto x2 = x;
  for (index_t t = 0; t < 7; ++t)
    for (index_t c = 0; c < C; ++c) x2[static_cast<std::size_t>(t * C + c)] += 100.0;  // change only sequence 0
  run(x2, y2);
  for (index_t t = 7; t < T; ++t)
    for (index_t c = 0; c < C; ++c) REQUIRE(y1[static_cast<std::size_t>(t * C + c)] == y2[static_cast<std::size_t>(t * C + c)]);
  // and each sequence alone (B = 1, no cu_seqlens) gives the same outputs
  for (std::size_t n = 0; n + 1 < cu.size(); ++n) {
    index_t const len = cu[n + 1] - cu[n];
    std::vector<double> ys(static_cast<std::size_t>(len * C));
    k3::kda::short_conv(serial, k3::kda::short_conv_args<double>{.x = k3::host_view(x.data() + cu[n] * C, 1, len, C),
                                                                 .weight = k3::host_view(w.data(), C, W), .y = k3::host_view(ys.data(), 1, len, C)});
    for (index_t i = 0; i < len * C; ++i) REQUIRE(ys[static_cast<std::size_t>(i)] == y1[static_cast<std::size_t>(cu[n] * C + i)]);
  }
}

TEST_CASE("short conv backward matches finite differences (double)") {
  index_t const C = 3, W = 4;
  for (bool silu : {true, false})
    for (bool varlen : {false, true})
      for (bool with_init : {false, true}) {
        CAPTURE(silu);
        CAPTURE(varlen);
        CAPTURE(with_init);
        std::vector<std::int64_t> cu = {0, 2, 2, 3, 9};
        index_t const B = varlen ? 1 : 2, T = varlen ? 9 : 6;
        auto seqs = varlen ? from_cu(cu) : batched(B, T);
        index_t const N = static_cast<index_t>(seqs.size());
        auto x = randn(static_cast<std::size_t>(B * T * C), 21);
        auto w = randn(static_cast<std::size_t>(C * W), 22, 0.7);
        auto bias = randn(C, 23, 0.3);
        auto init = randn(static_cast<std::size_t>(N * C * (W - 1)), 24);
        auto dy = randn(x.size(), 25);
        std::vector<double> dx(x.size()), dw(w.size()), db(bias.size()), dinit(init.size());
        auto xv = k3::host_view(x.data(), B, T, C);
        auto wv = k3::host_view(w.data(), C, W);
        auto bv = k3::host_view(bias.data(), C);
        auto dyv = k3::host_view(dy.data(), B, T, C);
        auto dxv = k3::host_view(dx.data(), B, T, C);
        auto dwv = k3::host_view(dw.data(), C, W);
        auto dbv = k3::host_view(db.data(), C);
        auto cuv = k3::host_view(cu.data(), static_cast<index_t>(cu.size()));
        auto iv = k3::host_view(init.data(), N, C, W - 1);
        auto div = k3::host_view(dinit.data(), N, C, W - 1);
        k3::kda::short_conv_options opt{.silu = silu};
        if (varlen) opt.cu_seqlens = cuv;
        k3::kda::short_conv_backward(serial,
                                     k3::kda::short_conv_backward_args<double>{.x = xv, .weight = wv, .bias = bv, .d_y = dyv, .d_x = dxv, .d_weight = dwv,
                                                                               .d_bias = dbv, .initial_state = with_init ? iv : decltype(iv){},
                                                                               .d_initial_state = with_init ? div : decltype(div){}},
                                     opt);
        auto loss = [&] {
          return dot(dy, ref_conv(x, B, T, C, w, W, bias, seqs, with_init ? init : std::vector<double>{}, silu).y);
        };
        check_fd(x, dx, loss, "dx");
        check_fd(w, dw, loss, "dweight");
        check_fd(bias, db, loss, "dbias");
        if (with_init) check_fd(init, dinit, loss, "d_initial_state");
      }
}

TEST_CASE("short conv backward: other kernel widths, no bias, float storage") {
  for (index_t W : {1, 2, 3, 5}) {
    CAPTURE(W);
    index_t const B = 2, T = 7, C = 4;
    auto x = randn(static_cast<std::size_t>(B * T * C), 31);
    auto w = randn(static_cast<std::size_t>(C * W), 32, 0.7);
    auto init = randn(static_cast<std::size_t>(B * C * (W - 1)), 33);
    auto dy = randn(x.size(), 34);
    std::vector<double> dx(x.size()), dw(w.size()), dinit(init.size());
    k3::kda::short_conv_backward(serial, k3::kda::short_conv_backward_args<double>{
                                             .x = k3::host_view(x.data(), B, T, C), .weight = k3::host_view(w.data(), C, W),
                                             .d_y = k3::host_view(dy.data(), B, T, C), .d_x = k3::host_view(dx.data(), B, T, C),
                                             .d_weight = k3::host_view(dw.data(), C, W), .initial_state = k3::host_view(init.data(), B, C, W - 1),
                                             .d_initial_state = k3::host_view(dinit.data(), B, C, W - 1)});
    auto loss = [&] { return dot(dy, ref_conv(x, B, T, C, w, W, {}, batched(B, T), init, true).y); };
    check_fd(x, dx, loss, "dx");
    check_fd(w, dw, loss, "dweight");
    check_fd(init, dinit, loss, "d_initial_state");
    // float storage, fp32 math: close to the double result
    auto xf = cast<float>(x), wf = cast<float>(w), inf = cast<float>(init), dyf = cast<float>(dy);
    std::vector<float> dxf(x.size()), dwf(w.size());
    k3::kda::short_conv_backward(serial, k3::kda::short_conv_backward_args<float>{
                                             .x = k3::host_view(xf.data(), B, T, C), .weight = k3::host_view(wf.data(), C, W),
                                             .d_y = k3::host_view(dyf.data(), B, T, C), .d_x = k3::host_view(dxf.data(), B, T, C),
                                             .d_weight = k3::host_view(dwf.data(), C, W), .initial_state = k3::host_view(inf.data(), B, C, W - 1)});
    check_close(widen(dxf), dx, 1e-5, 1e-5, "dx float");
    check_close(widen(dwf), dw, 1e-5, 1e-5, "dweight float");
  }
}

TEST_CASE_TEMPLATE("decode token by token after a prefill equals the full convolution", S, double, float) {
  // Sequences of different lengths, prefilled to different points (0 included), then decoded
  // through a pool of states addressed by shuffled slots. Untouched slots stay bit-identical.
  index_t const C = 6, W = 4;
  std::vector<index_t> len = {9, 4, 13, 1};
  std::vector<index_t> pre = {5, 0, 12, 1};
  index_t const N = static_cast<index_t>(len.size()), P = 7;
  std::vector<std::int32_t> slots = {5, 0, 3, 6};
  auto w = cast<S>(randn(static_cast<std::size_t>(C * W), 41, 0.6));
  auto bias = cast<S>(randn(C, 42, 0.3));
  std::vector<std::vector<S>> xs;
  for (index_t n = 0; n < N; ++n) xs.push_back(cast<S>(randn(static_cast<std::size_t>(len[n] * C), 43 + n)));
  auto pool = cast<S>(randn(static_cast<std::size_t>(P * C * (W - 1)), 50));
  auto const pool0 = pool;
  for (index_t n = 0; n < N; ++n) {
    // full convolution of the whole sequence (zero initial state)
    std::vector<S> yfull(xs[n].size()), ffull(static_cast<std::size_t>(C * (W - 1)));
    k3::kda::short_conv(serial, k3::kda::short_conv_args<S>{.x = k3::host_view(xs[n].data(), 1, len[n], C), .weight = k3::host_view(w.data(), C, W),
                                                            .bias = k3::host_view(bias.data(), C), .y = k3::host_view(yfull.data(), 1, len[n], C),
                                                            .final_state = k3::host_view(ffull.data(), 1, C, W - 1)});
    // prefill the first pre[n] tokens into the pool slot
    auto slot_view = k3::host_view(pool.data() + slots[n] * C * (W - 1), 1, C, W - 1);
    std::vector<S> ypre(static_cast<std::size_t>(pre[n] * C));
    std::vector<S> zero(static_cast<std::size_t>(C * (W - 1)), S(0));
    k3::kda::short_conv(serial, k3::kda::short_conv_args<S>{.x = k3::host_view(xs[n].data(), 1, pre[n], C), .weight = k3::host_view(w.data(), C, W),
                                                            .bias = k3::host_view(bias.data(), C), .y = k3::host_view(ypre.data(), 1, pre[n], C),
                                                            .initial_state = k3::host_view(zero.data(), 1, C, W - 1), .final_state = slot_view});
    for (index_t i = 0; i < pre[n] * C; ++i) REQUIRE(ypre[static_cast<std::size_t>(i)] == yfull[static_cast<std::size_t>(i)]);
    // decode the rest one token at a time
    for (index_t t = pre[n]; t < len[n]; ++t) {
      std::vector<S> y1(static_cast<std::size_t>(C));
      k3::kda::short_conv_decode(serial, k3::kda::short_conv_decode_args<S>{.x = k3::host_view(xs[n].data() + t * C, 1, C),
                                                                           .weight = k3::host_view(w.data(), C, W), .bias = k3::host_view(bias.data(), C),
                                                                           .conv_state = k3::host_view(pool.data(), P, C, W - 1),
                                                                           .y = k3::host_view(y1.data(), 1, C), .slots32 = k3::host_view(slots.data() + n, 1)});
      double const tol = std::is_same_v<S, double> ? 1e-14 : 1e-6;
      for (index_t c = 0; c < C; ++c) {
        double const a = y1[static_cast<std::size_t>(c)], b = yfull[static_cast<std::size_t>(t * C + c)];
        REQUIRE(std::fabs(a - b) <= tol * (1 + std::fabs(b)));
      }
    }
    for (index_t i = 0; i < C * (W - 1); ++i)  // the state holds raw inputs: exact
      REQUIRE(slot_view.data_handle()[i] == ffull[static_cast<std::size_t>(i)]);
  }
  std::vector<bool> used(static_cast<std::size_t>(P), false);
  for (auto s : slots) used[static_cast<std::size_t>(s)] = true;
  for (index_t p = 0; p < P; ++p)
    if (!used[static_cast<std::size_t>(p)])
      for (index_t i = 0; i < C * (W - 1); ++i) {
        std::size_t const at = static_cast<std::size_t>(p * C * (W - 1) + i);
        REQUIRE(pool[at] == pool0[at]);
      }
}

TEST_CASE("batched decode over a pool equals per-sequence decode, no slots means slot n") {
  index_t const C = 8, W = 4, N = 3, P = 5;
  auto w = randn(static_cast<std::size_t>(C * W), 61);
  auto x = randn(static_cast<std::size_t>(N * C), 62);
  auto pool = randn(static_cast<std::size_t>(P * C * (W - 1)), 63);
  std::vector<std::int64_t> slots = {4, 1, 2};
  auto pool_a = pool, pool_b = pool;
  std::vector<double> ya(x.size()), yb(x.size());
  k3::cpu::threads<> th(2);
  k3::kda::short_conv_decode(th, k3::kda::short_conv_decode_args<double>{.x = k3::host_view(x.data(), N, C), .weight = k3::host_view(w.data(), C, W),
                                                                        .conv_state = k3::host_view(pool_a.data(), P, C, W - 1),
                                                                        .y = k3::host_view(ya.data(), N, C), .slots64 = k3::host_view(slots.data(), N)});
  for (index_t n = 0; n < N; ++n)
    k3::kda::short_conv_decode(serial, k3::kda::short_conv_decode_args<double>{
                                           .x = k3::host_view(x.data() + n * C, 1, C), .weight = k3::host_view(w.data(), C, W),
                                           .conv_state = k3::host_view(pool_b.data() + slots[static_cast<std::size_t>(n)] * C * (W - 1), 1, C, W - 1),
                                           .y = k3::host_view(yb.data() + n * C, 1, C)});
  CHECK(ya == yb);
  CHECK(pool_a == pool_b);
  // the reference: y = silu(sum_j<W-1 w_j state_j + w_{W-1} x)
  for (index_t n = 0; n < N; ++n)
    for (index_t c = 0; c < C; ++c) {
      std::size_t const s = static_cast<std::size_t>(slots[static_cast<std::size_t>(n)]);
      double z = w[static_cast<std::size_t>(c * W + W - 1)] * x[static_cast<std::size_t>(n * C + c)];
      for (index_t j = 0; j < W - 1; ++j) z += w[static_cast<std::size_t>(c * W + j)] * pool[(s * C + c) * (W - 1) + j];
      CHECK(ya[static_cast<std::size_t>(n * C + c)] == doctest::Approx(z / (1 + std::exp(-z))).epsilon(1e-13));
    }
}

TEST_CASE("in-place state update: final_state may be the initial_state view") {
  index_t const B = 2, T = 2, C = 3, W = 4;  // T < W-1: the final state reaches into the initial one
  auto x = randn(static_cast<std::size_t>(B * T * C), 71);
  auto w = randn(static_cast<std::size_t>(C * W), 72);
  auto st = randn(static_cast<std::size_t>(B * C * (W - 1)), 73);
  auto st_copy = st;
  std::vector<double> y1(x.size()), y2(x.size()), fs(st.size());
  k3::kda::short_conv(serial, k3::kda::short_conv_args<double>{.x = k3::host_view(x.data(), B, T, C), .weight = k3::host_view(w.data(), C, W),
                                                               .y = k3::host_view(y1.data(), B, T, C),
                                                               .initial_state = k3::host_view(st_copy.data(), B, C, W - 1),
                                                               .final_state = k3::host_view(fs.data(), B, C, W - 1)});
  auto sv = k3::host_view(st.data(), B, C, W - 1);
  k3::kda::short_conv(serial, k3::kda::short_conv_args<double>{.x = k3::host_view(x.data(), B, T, C), .weight = k3::host_view(w.data(), C, W),
                                                               .y = k3::host_view(y2.data(), B, T, C), .initial_state = sv, .final_state = sv});
  CHECK(y1 == y2);
  CHECK(st == fs);
}

TEST_CASE("serial and threads agree bitwise, forward and backward") {
  k3::cpu::threads<> th(3);
  std::vector<std::int64_t> cu = {0, 100, 101, 350, 700};
  index_t const T = 700, C = 16, W = 4, N = 4;
  auto x = cast<float>(randn(static_cast<std::size_t>(T * C), 81));
  auto w = cast<float>(randn(static_cast<std::size_t>(C * W), 82));
  auto bias = cast<float>(randn(C, 83));
  auto init = cast<float>(randn(static_cast<std::size_t>(N * C * (W - 1)), 84));
  auto dy = cast<float>(randn(x.size(), 85));
  auto run = [&](auto const& bk) {
    std::vector<float> y(x.size()), fs(init.size()), dx(x.size()), dw(w.size()), db(bias.size()), di(init.size());
    auto xv = k3::host_view(x.data(), 1, T, C);
    auto wv = k3::host_view(w.data(), C, W);
    auto bv = k3::host_view(bias.data(), C);
    auto cuv = k3::host_view(cu.data(), N + 1);
    auto iv = k3::host_view(init.data(), N, C, W - 1);
    k3::kda::short_conv(bk,
                        k3::kda::short_conv_args<float>{.x = xv, .weight = wv, .bias = bv, .y = k3::host_view(y.data(), 1, T, C), .initial_state = iv,
                                                        .final_state = k3::host_view(fs.data(), N, C, W - 1)},
                        {.cu_seqlens = cuv});
    k3::kda::short_conv_backward(bk,
                                 k3::kda::short_conv_backward_args<float>{.x = xv, .weight = wv, .bias = bv, .d_y = k3::host_view(dy.data(), 1, T, C),
                                                                          .d_x = k3::host_view(dx.data(), 1, T, C), .d_weight = k3::host_view(dw.data(), C, W),
                                                                          .d_bias = k3::host_view(db.data(), C), .initial_state = iv,
                                                                          .d_initial_state = k3::host_view(di.data(), N, C, W - 1)},
                                 {.cu_seqlens = cuv});
    return std::vector<std::vector<float>>{y, fs, dx, dw, db, di};
  };
  auto a = run(serial);
  auto b = run(th);
  for (std::size_t i = 0; i < a.size(); ++i) CHECK(a[i] == b[i]);
}

TEST_CASE("memory tuning (prefetch, streaming stores) never changes the numbers") {
  // Cache-line aligned rows of 272 channels: whole 64-channel blocks are streamed, the rest
  // stored plainly; compared with a call that neither prefetches nor streams.
  k3::cpu::threads<> th(3);
  std::vector<std::int64_t> cu = {0, 2, 130, 300};
  index_t const T = 300, C = 272, W = 4, N = 3;
  using aligned = std::vector<float, xsimd::aligned_allocator<float, 64>>;
  auto fill = [](std::size_t n, std::uint64_t seed) {
    auto v = cast<float>(randn(n, seed));
    return aligned(v.begin(), v.end());
  };
  aligned const x = fill(static_cast<std::size_t>(T * C), 91), w = fill(static_cast<std::size_t>(C * W), 92), bias = fill(C, 93);
  k3::kda::preprocess_tuning const plain{.prefetch_rows = 0, .stream_min_bytes = ~std::size_t{0}};
  k3::kda::preprocess_tuning const tuned{.prefetch_rows = 5, .stream_min_bytes = 0};
  auto run = [&](auto const& bk, k3::kda::preprocess_tuning const& tune) {
    aligned y(x.size(), -1.0f);
    k3::kda::short_conv(bk,
                        k3::kda::short_conv_args<float>{.x = k3::host_view(x.data(), 1, T, C), .weight = k3::host_view(w.data(), C, W),
                                                        .bias = k3::host_view(bias.data(), C), .y = k3::host_view(y.data(), 1, T, C)},
                        {.cu_seqlens = k3::host_view(cu.data(), N + 1), .tuning = tune});
    return y;
  };
  aligned const ref = run(serial, plain);
  CHECK(run(serial, tuned) == ref);
  CHECK(run(th, tuned) == ref);
  CHECK(run(k3::cpu::simd<>{}, tuned) == ref);
}

TEST_CASE("bfloat16 storage backward against double on the same inputs") {
  index_t const B = 1, T = 40, C = 8, W = 4;
  auto x = cast<bfloat16>(randn(static_cast<std::size_t>(B * T * C), 91));
  auto w = cast<bfloat16>(randn(static_cast<std::size_t>(C * W), 92, 0.5));
  auto dy = cast<bfloat16>(randn(x.size(), 93));
  std::vector<bfloat16> dx(x.size());
  std::vector<float> dw(w.size());
  // bfloat16 activations, fp32 parameters: the bf16 weight widened (exactly) to float.
  std::vector<float> wf(w.size());
  for (std::size_t i = 0; i < w.size(); ++i) wf[i] = k3::load_as<float>(w[i]);
  k3::kda::short_conv_backward(serial, k3::kda::short_conv_backward_args<bfloat16, float>{
                                           .x = k3::host_view(x.data(), B, T, C), .weight = k3::host_view(wf.data(), C, W),
                                           .d_y = k3::host_view(dy.data(), B, T, C), .d_x = k3::host_view(dx.data(), B, T, C),
                                           .d_weight = k3::host_view(dw.data(), C, W)});
  auto xd = widen(x), wd = widen(w), dyd = widen(dy);
  std::vector<double> dxr(x.size()), dwr(w.size());
  k3::kda::short_conv_backward(serial, k3::kda::short_conv_backward_args<double>{
                                           .x = k3::host_view(xd.data(), B, T, C), .weight = k3::host_view(wd.data(), C, W),
                                           .d_y = k3::host_view(dyd.data(), B, T, C), .d_x = k3::host_view(dxr.data(), B, T, C),
                                           .d_weight = k3::host_view(dwr.data(), C, W)});
  check_close(widen(dx), dxr, 8e-3, 1e-2, "dx bf16");
  check_close(widen(dw), dwr, 1e-5, 1e-5, "dweight fp32 from bf16 inputs");
}

TEST_CASE("bad input names the argument") {
  index_t const T = 6, C = 3, W = 4;
  std::vector<double> x(static_cast<std::size_t>(2 * T * C)), y(x.size()), w(static_cast<std::size_t>(C * W)), buf(200);
  auto xv = k3::host_view(x.data(), 1, T, C);
  auto yv = k3::host_view(y.data(), 1, T, C);
  auto wv = k3::host_view(w.data(), C, W);
  auto has = [](std::string const& m, char const* s) {
    INFO(m);
    CHECK(m.find(s) != std::string::npos);
  };
  using Args = k3::kda::short_conv_args<double>;
  using BwdArgs = k3::kda::short_conv_backward_args<double>;
  has(k3::test::error_of([&] { k3::kda::short_conv(serial, Args{.x = xv, .weight = k3::host_view(w.data(), C + 1, 2), .y = yv}); }), "'weight'");
  has(k3::test::error_of([&] { k3::kda::short_conv(serial, Args{.x = xv, .weight = k3::host_view(w.data(), C, 0), .y = yv}); }), "'weight'");
  has(k3::test::error_of([&] { k3::kda::short_conv(serial, Args{.x = xv, .weight = wv, .bias = k3::host_view(buf.data(), C + 1), .y = yv}); }), "'bias'");
  has(k3::test::error_of([&] { k3::kda::short_conv(serial, Args{.x = xv, .weight = wv, .y = k3::host_view(buf.data(), 1, T, C + 1)}); }), "'y'");
  has(k3::test::error_of([&] { k3::kda::short_conv(serial, Args{.x = xv, .weight = wv, .y = xv}); }), "overlap");
  std::vector<std::int64_t> bad1 = {1, 6}, bad2 = {0, 4, 3, 6}, bad3 = {0, 5};
  has(k3::test::error_of([&] { k3::kda::short_conv(serial, Args{.x = xv, .weight = wv, .y = yv}, {.cu_seqlens = k3::host_view(bad1.data(), 2)}); }),
      "start at 0");
  has(k3::test::error_of([&] { k3::kda::short_conv(serial, Args{.x = xv, .weight = wv, .y = yv}, {.cu_seqlens = k3::host_view(bad2.data(), 4)}); }),
      "non-decreasing");
  has(k3::test::error_of([&] { k3::kda::short_conv(serial, Args{.x = xv, .weight = wv, .y = yv}, {.cu_seqlens = k3::host_view(bad3.data(), 2)}); }),
      "end at T");
  std::vector<std::int64_t> good = {0, 6};
  has(k3::test::error_of([&] {
        k3::kda::short_conv(serial, Args{.x = k3::host_view(x.data(), 2, T, C), .weight = wv, .y = k3::host_view(y.data(), 2, T, C)},
                            {.cu_seqlens = k3::host_view(good.data(), 2)});
      }),
      "'cu_seqlens'");
  has(k3::test::error_of([&] { k3::kda::short_conv(serial, Args{.x = xv, .weight = wv, .y = yv, .initial_state = k3::host_view(buf.data(), 1, C, W)}); }),
      "'initial_state'");
  has(k3::test::error_of([&] { k3::kda::short_conv(serial, Args{.x = xv, .weight = wv, .y = yv, .final_state = k3::host_view(buf.data(), 2, C, W - 1)}); }),
      "'final_state'");
  has(k3::test::error_of([&] {
        k3::kda::short_conv_backward(serial, BwdArgs{.x = xv, .weight = wv, .d_y = k3::host_view(buf.data(), 1, T + 1, C), .d_x = yv});
      }),
      "'d_y'");
  has(k3::test::error_of([&] {
        k3::kda::short_conv_backward(serial, BwdArgs{.x = xv, .weight = wv, .d_y = xv, .d_x = yv, .d_weight = k3::host_view(buf.data(), C, W + 1)});
      }),
      "'d_weight'");
  // decode
  std::vector<double> xs(static_cast<std::size_t>(2 * C)), ys(xs.size()), pool(static_cast<std::size_t>(3 * C * (W - 1)));
  auto xsv = k3::host_view(xs.data(), 2, C);
  auto ysv = k3::host_view(ys.data(), 2, C);
  auto pv = k3::host_view(pool.data(), 3, C, W - 1);
  std::vector<std::int32_t> out_of_range = {0, 3}, negative = {-1, 0}, twice = {1, 1};
  using DecArgs = k3::kda::short_conv_decode_args<double>;
  auto decode_with = [&](k3::tensor_view<std::int32_t const, 1> slots) {
    k3::kda::short_conv_decode(serial, DecArgs{.x = xsv, .weight = wv, .conv_state = pv, .y = ysv, .slots32 = slots});
  };
  has(k3::test::error_of([&] { decode_with(k3::host_view(out_of_range.data(), 2)); }), "'slots32'");
  has(k3::test::error_of([&] { decode_with(k3::host_view(negative.data(), 2)); }), "'slots32'");
  has(k3::test::error_of([&] { decode_with(k3::host_view(twice.data(), 2)); }), "twice");
  has(k3::test::error_of([&] { decode_with(k3::host_view(twice.data(), 1)); }), "'slots32'");
  has(k3::test::error_of([&] { k3::kda::short_conv_decode(serial, DecArgs{.x = xsv, .weight = wv, .conv_state = k3::host_view(pool.data(), 1, C, W - 1), .y = ysv}); }),
      "'conv_state'");
  has(k3::test::error_of([&] { k3::kda::short_conv_decode(serial, DecArgs{.x = xsv, .weight = wv, .conv_state = k3::host_view(pool.data(), 2, C, W), .y = ysv}); }),
      "'conv_state'");
  has(k3::test::error_of([&] { k3::kda::short_conv_decode(serial, DecArgs{.x = xsv, .weight = wv, .conv_state = pv, .y = k3::host_view(ys.data(), 1, C)}); }),
      "'y'");
}

TEST_CASE("empty shapes: no tokens, empty sequences pass the initial state through") {
  index_t const C = 3, W = 4;
  auto w = randn(static_cast<std::size_t>(C * W), 101);
  auto init = randn(static_cast<std::size_t>(2 * C * (W - 1)), 102);
  std::vector<double> fs(init.size(), -1.0), none;
  // B = 2 rows of T = 0 tokens
  k3::kda::short_conv(serial, k3::kda::short_conv_args<double>{.x = k3::host_view(none.data(), 2, 0, C), .weight = k3::host_view(w.data(), C, W),
                                                               .y = k3::host_view(none.data(), 2, 0, C),
                                                               .initial_state = k3::host_view(init.data(), 2, C, W - 1),
                                                               .final_state = k3::host_view(fs.data(), 2, C, W - 1)});
  CHECK(fs == init);
  std::vector<double> di(init.size(), -1.0), dw(w.size(), -1.0);
  k3::kda::short_conv_backward(serial, k3::kda::short_conv_backward_args<double>{
                                           .x = k3::host_view(none.data(), 2, 0, C), .weight = k3::host_view(w.data(), C, W),
                                           .d_y = k3::host_view(none.data(), 2, 0, C), .d_x = k3::host_view(none.data(), 2, 0, C),
                                           .d_weight = k3::host_view(dw.data(), C, W), .initial_state = k3::host_view(init.data(), 2, C, W - 1),
                                           .d_initial_state = k3::host_view(di.data(), 2, C, W - 1)});
  for (double v : di) CHECK(v == 0.0);
  for (double v : dw) CHECK(v == 0.0);
  // B = 0
  k3::kda::short_conv(serial, k3::kda::short_conv_args<double>{.x = k3::host_view(none.data(), 0, 5, C), .weight = k3::host_view(w.data(), C, W),
                                                               .y = k3::host_view(none.data(), 0, 5, C)});
  // decode with N = 0
  std::vector<double> pool(static_cast<std::size_t>(C * (W - 1)));
  k3::kda::short_conv_decode(serial, k3::kda::short_conv_decode_args<double>{.x = k3::host_view(none.data(), 0, C), .weight = k3::host_view(w.data(), C, W),
                                                                            .conv_state = k3::host_view(pool.data(), 1, C, W - 1),
                                                                            .y = k3::host_view(none.data(), 0, C)});
}

TEST_CASE("a NaN in one sequence stays in that sequence (forward and dx)") {
  index_t const C = 4, W = 4, T = 30;
  std::vector<std::int64_t> cu = {0, 10, 30};
  auto x = randn(static_cast<std::size_t>(T * C), 111);
  auto w = randn(static_cast<std::size_t>(C * W), 112);
  auto dy = randn(x.size(), 113);
  x[static_cast<std::size_t>(9 * C + 1)] = std::nan("");  // last token of sequence 0, channel 1
  std::vector<double> y(x.size()), dx(x.size());
  auto xv = k3::host_view(x.data(), 1, T, C);
  auto wv = k3::host_view(w.data(), C, W);
  auto cuv = k3::host_view(cu.data(), 3);
  k3::kda::short_conv(serial, k3::kda::short_conv_args<double>{.x = xv, .weight = wv, .y = k3::host_view(y.data(), 1, T, C)}, {.cu_seqlens = cuv});
  k3::kda::short_conv_backward(serial,
                               k3::kda::short_conv_backward_args<double>{.x = xv, .weight = wv, .d_y = k3::host_view(dy.data(), 1, T, C),
                                                                         .d_x = k3::host_view(dx.data(), 1, T, C)},
                               {.cu_seqlens = cuv});
  for (index_t t = 0; t < T; ++t)
    for (index_t c = 0; c < C; ++c) {
      bool const poisoned = t == 9 && c == 1;  // depthwise: other channels and sequences stay clean
      CHECK(std::isnan(y[static_cast<std::size_t>(t * C + c)]) == poisoned);
      CHECK(std::isnan(dx[static_cast<std::size_t>(t * C + c)]) == (c == 1 && t >= 6 && t <= 9));
    }
}
