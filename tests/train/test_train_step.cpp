// k3::train::train_step: the stack's gradients against central differences of its loss
// (float64), recompute and offload equal to keep bit for bit, fp8 and mixed within E4M3's
// rounding, the bytes each preset saves against a count of what each layer must keep, the
// pools empty after the step, and the errors.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "k3/backend/cpu/serial.hpp"
#include "k3/backend/cpu/simd.hpp"
#include "k3/train/stack.hpp"
#include "support/error_of.hpp"
#include "support/metrics.hpp"

namespace tr = k3::train;
using k3::index_t;

namespace {

// A small stack with a short last chunk (tokens not a multiple of 64) and odd expert sizes.
tr::stack_config small(index_t tokens = 70, index_t layers = 2) {
  tr::stack_config c;
  c.layers = layers;
  c.tokens = tokens;
  c.heads = 2;
  c.head_dim = 8;
  c.experts = 5;
  c.top_k = 2;
  c.latent = 6;
  c.expert_ffn = 7;
  c.seed = 3;
  return c;
}

template <class T>
double loss(std::vector<T> const& y, std::vector<T> const& dy) {
  double s = 0;
  for (std::size_t i = 0; i < y.size(); ++i) s += static_cast<double>(y[i]) * static_cast<double>(dy[i]);
  return s;
}

template <class T>
std::vector<T> concat(tr::named_tensors<T> const& g) {
  std::vector<T> all;
  for (auto const& v : g.values) all.insert(all.end(), v.begin(), v.end());
  return all;
}

template <class T>
bool same_bits(std::vector<T> const& a, std::vector<T> const& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// What the keep preset must save, counted from the shapes: per KDA layer twelve [T, d]
// tensors (x, four projections, two conv outputs, q, k, v, g, o), two [T, heads] (the beta
// projection and beta) and the per-chunk states; the MoE layer's x, z, normalised u, h_gate,
// h_up, two per-token and two per-slot scalars, expert ids and slots (int64), the expert
// offsets and a per-token flag byte.
std::size_t keep_bytes(tr::stack_config const& c, std::size_t value) {
  std::size_t const T = static_cast<std::size_t>(c.tokens), d = static_cast<std::size_t>(c.d()), H = static_cast<std::size_t>(c.heads),
                    K = static_cast<std::size_t>(c.head_dim), chunks = (T + 63) / 64;
  std::size_t const record = K * K + 3 * 64 * 64 + 2 * 64 * K;
  std::size_t const kda = (12 * T * d + 2 * T * H + H * chunks * record) * value;
  std::size_t const k = static_cast<std::size_t>(c.top_k), l = static_cast<std::size_t>(c.latent), f = static_cast<std::size_t>(c.expert_ffn);
  std::size_t const moe = (T * d + 2 * T * l + 2 * T * k * f + 2 * T + 2 * T * k) * value + 2 * T * k * 8 +
                          (static_cast<std::size_t>(c.experts) + 1) * 8 + T;
  return static_cast<std::size_t>(c.layers) * kda + moe;
}

}  // namespace

TEST_CASE("train_step: float64 gradients of every parameter match central differences of <y, dy>") {
  k3::cpu::threads<> b(2);
  for (index_t tokens : {index_t(70), index_t(1)}) {
    CAPTURE(tokens);
    tr::stack_config const c = small(tokens);
    auto params = tr::stack_parameters<double>(c);
    auto const in = tr::stack_inputs<double>(c);
    auto const r = tr::train_step(b, tr::train_step_args<double>{&params, &in}, {c, tr::step_policy::keep});
    double const h = 1e-6;
    unsigned pick = 12345;
    for (std::size_t t = 0; t < params.size(); ++t) {
      CAPTURE(params.names[t]);
      std::size_t const n = params.values[t].size();
      for (int rep = 0; rep < 3; ++rep) {
        pick = pick * 1103515245u + 12345u;
        std::size_t const i = (pick >> 8) % n;
        double const keep_v = params.values[t][i];
        params.values[t][i] = keep_v + h;
        double const up = loss(tr::train_step(b, tr::train_step_args<double>{&params, &in}, {c, tr::step_policy::keep}).y, in.dy);
        params.values[t][i] = keep_v - h;
        double const down = loss(tr::train_step(b, tr::train_step_args<double>{&params, &in}, {c, tr::step_policy::keep}).y, in.dy);
        params.values[t][i] = keep_v;
        double const fd = (up - down) / (2 * h), g = r.gradients.values[t][i];
        CAPTURE(i);
        CHECK(std::abs(g - fd) <= 2e-6 * std::max(1.0, std::abs(fd)));
      }
    }
  }
}

TEST_CASE("train_step: recompute and offload give keep's gradients bit for bit, fp8 and mixed within E4M3's rounding") {
  k3::cpu::threads<> b(2);
  for (index_t tokens : {index_t(70), index_t(1), index_t(130)}) {
    CAPTURE(tokens);
    tr::stack_config const c = small(tokens, 3);
    auto const params = tr::stack_parameters<float>(c);
    auto const in = tr::stack_inputs<float>(c);
    auto const keep = tr::train_step(b, tr::train_step_args<float>{&params, &in}, {c, tr::step_policy::keep});
    auto const ref = concat(keep.gradients);
    for (auto p : {tr::step_policy::recompute, tr::step_policy::offload}) {
      CAPTURE(std::string(tr::name_of(p)));
      auto const r = tr::train_step(b, tr::train_step_args<float>{&params, &in}, {c, p});
      CHECK(same_bits(concat(r.gradients), ref));
      CHECK(same_bits(r.y, keep.y));
    }
    for (auto p : {tr::step_policy::fp8, tr::step_policy::mixed}) {
      CAPTURE(std::string(tr::name_of(p)));
      auto const r = tr::train_step(b, tr::train_step_args<float>{&params, &in}, {c, p});
      double const e = k3::test::rel_rms(concat(r.gradients), ref);
      CAPTURE(e);
      // E4M3 keeps 3 mantissa bits: a value's relative rounding error is at most 2^-4.
      CHECK(e > 0);
      CHECK(e < 0.125);
      CHECK(same_bits(r.y, keep.y));  // the forward itself is not rounded
    }
  }
}

TEST_CASE("train_step: the same gradients on 1, 2 and 3 threads and for the serial backend's equal inputs twice") {
  tr::stack_config const c = small(100, 2);
  auto const params = tr::stack_parameters<float>(c);
  auto const in = tr::stack_inputs<float>(c);
  auto const one = concat(tr::train_step(k3::cpu::threads<>(1), tr::train_step_args<float>{&params, &in}, {c, tr::step_policy::mixed}).gradients);
  CHECK(same_bits(concat(tr::train_step(k3::cpu::threads<>(2), tr::train_step_args<float>{&params, &in}, {c, tr::step_policy::mixed}).gradients), one));
  CHECK(same_bits(concat(tr::train_step(k3::cpu::threads<>(3), tr::train_step_args<float>{&params, &in}, {c, tr::step_policy::mixed}).gradients), one));
  k3::cpu::serial s;
  auto const a = concat(tr::train_step(s, tr::train_step_args<float>{&params, &in}, {c, tr::step_policy::recompute}).gradients);
  CHECK(same_bits(concat(tr::train_step(s, tr::train_step_args<float>{&params, &in}, {c, tr::step_policy::recompute}).gradients), a));
  // Another seed gives other parameters, inputs and gradients.
  tr::stack_config c2 = c;
  c2.seed = c.seed + 1;
  auto const params2 = tr::stack_parameters<float>(c2);
  auto const in2 = tr::stack_inputs<float>(c2);
  auto const other = concat(tr::train_step(k3::cpu::threads<>(1), tr::train_step_args<float>{&params2, &in2}, {c2, tr::step_policy::mixed}).gradients);
  CHECK(!same_bits(other, one));
}

TEST_CASE("train_step: what each preset saves, resident and offloaded, the pools are empty after the step") {
  k3::cpu::threads<> b(2);
  for (index_t tokens : {index_t(70), index_t(256)}) {
    CAPTURE(tokens);
    tr::stack_config const c = small(tokens, 4);
    auto const params = tr::stack_parameters<float>(c);
    auto const in = tr::stack_inputs<float>(c);
    auto run = [&](tr::step_policy p) { return tr::train_step(b, tr::train_step_args<float>{&params, &in}, {c, p}).stats; };
    auto const keep = run(tr::step_policy::keep), rec = run(tr::step_policy::recompute), f8 = run(tr::step_policy::fp8),
               off = run(tr::step_policy::offload), mix = run(tr::step_policy::mixed);
    std::size_t const td4 = static_cast<std::size_t>(c.tokens * c.d()) * 4;
    CHECK(keep.saved_bytes == keep_bytes(c, 4));
    CHECK(keep.resident_peak_bytes == keep.saved_bytes);
    CHECK(keep.host_peak_bytes == 0);
    // recompute keeps the layer inputs only.
    CHECK(rec.saved_bytes == static_cast<std::size_t>(c.layers + 1) * td4);
    CHECK(f8.saved_bytes <= keep.saved_bytes * 6 / 10);
    CHECK(f8.host_peak_bytes == 0);
    CHECK(off.saved_bytes == keep.saved_bytes);
    CHECK(off.host_peak_bytes == keep.saved_bytes);
    // Only prefetched layers are resident: at most the two largest layers' bytes.
    CHECK(off.resident_peak_bytes <= keep.saved_bytes / 2);
    CHECK(off.resident_peak_bytes > 0);
    CHECK(mix.saved_bytes < f8.saved_bytes);
    CHECK(mix.resident_peak_bytes < mix.saved_bytes);
    for (auto const& s : {keep, rec, f8, off, mix}) {
      CHECK(s.resident_bytes == 0);
      CHECK(s.host_bytes == 0);
    }
  }
}

TEST_CASE("train_step: errors name the setting") {
  k3::cpu::serial b;
  tr::stack_config c = small(10, 1);
  auto const params = tr::stack_parameters<float>(c);
  auto const in = tr::stack_inputs<float>(c);
  tr::stack_config bad = c;
  bad.top_k = 6;
  CHECK(k3::test::error_of([&] { (void)tr::stack_parameters<float>(bad); }).find("'top_k' must be <= experts (5), got 6") != std::string::npos);
  bad = c;
  bad.layers = 0;
  CHECK(k3::test::error_of([&] { (void)tr::stack_inputs<float>(bad); }).find("'layers' must be >= 1, got 0") != std::string::npos);
  bad = c;
  bad.gate_lower_bound = -6;
  CHECK(k3::test::error_of([&] { (void)tr::train_step(b, tr::train_step_args<float>{&params, &in}, {bad, tr::step_policy::keep}); }).find("'gate_lower_bound'") !=
        std::string::npos);
  bad = c;
  bad.layers = 2;
  auto in_bad = tr::stack_inputs<float>(bad);
  CHECK(k3::test::error_of([&] { (void)tr::train_step(b, tr::train_step_args<float>{&params, &in_bad}, {bad, tr::step_policy::keep}); })
            .find("argument 'parameters': expected 29 tensors") != std::string::npos);
  bad = c;
  bad.head_dim = 4;
  in_bad = tr::stack_inputs<float>(bad);
  CHECK(k3::test::error_of([&] { (void)tr::train_step(b, tr::train_step_args<float>{&params, &in_bad}, {bad, tr::step_policy::keep}); })
            .find("tensor 'kda0.w_q' has another shape") != std::string::npos);
  bad = c;
  bad.tokens = 11;
  CHECK(k3::test::error_of([&] { (void)tr::train_step(b, tr::train_step_args<float>{&params, &in}, {bad, tr::step_policy::keep}); }).find("argument 'input'") != std::string::npos);
  CHECK(k3::test::error_of([&] { (void)tr::train_step(b, tr::train_step_args<float>{&params, nullptr}, {c, tr::step_policy::keep}); })
            .find("arguments 'parameters', 'input': required") != std::string::npos);
  CHECK(tr::parse_step_policy("mixed") == tr::step_policy::mixed);
  CHECK(!tr::parse_step_policy("chunked").has_value());
}
