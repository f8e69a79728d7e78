// Shared helpers for the block-quantization tests: random inputs with per-row magnitudes,
// the three CPU backends, and per-element quantisation error bounds.
#pragma once
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "k3/backend/cpu/serial.hpp"
#include "k3/backend/cpu/simd.hpp"
#include "k3/quant.hpp"

namespace qt {

using k3::index_t;

inline index_t cdiv(index_t a, index_t b) { return (a + b - 1) / b; }

// Values with magnitudes spread over many binades (rows and columns scaled differently, so
// tiles of different shapes see different amax), plus exact zeros and values on E4M3/E2M1
// rounding ties after scaling.
inline std::vector<float> random_matrix(index_t m, index_t k, std::uint32_t seed, float spread = 6.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(-spread, spread);
  std::vector<float> row_scale(static_cast<std::size_t>(m)), col_scale(static_cast<std::size_t>(k));
  for (auto& r : row_scale) r = std::exp2(ud(rng));
  for (auto& c : col_scale) c = std::exp2(ud(rng) / 3);
  std::vector<float> x(static_cast<std::size_t>(m * k));
  for (index_t i = 0; i < m; ++i)
    for (index_t j = 0; j < k; ++j) {
      float v = nd(rng) * row_scale[i] * col_scale[j];
      if (rng() % 37 == 0) v = 0.0f;
      if (rng() % 41 == 0) v = row_scale[i] * (1.0f + 1.0f / 16.0f) * ((rng() & 1) ? 1.0f : -1.0f);  // a tie in many binades
      x[static_cast<std::size_t>(i * k + j)] = v;
    }
  return x;
}

inline std::vector<k3::bfloat16> to_bf16(std::vector<float> const& x) {
  std::vector<k3::bfloat16> r(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) r[i] = k3::bfloat16(x[i]);
  return r;
}

// Largest |error| allowed when v = |x| / X is rounded to format F (saturating): half an ulp
// of v's binade (relative 2^-(m+1) for normals, half the subnormal step below), or the
// clipping error beyond max. Scaled back by X, with a little slack for the fp32 scale products.
template <class F>
double element_bound(double ax, double X) {
  double const v = ax / X;
  double const mx = k3::decode<F>(static_cast<std::uint8_t>(F::max_code));
  double const mn = k3::decode<F>(static_cast<std::uint8_t>(1u << F::mbits));
  double const dn = k3::decode<F>(1);
  double b;
  if (v >= mx)
    b = v - mx + mx * std::ldexp(1.0, -(F::mbits + 1));
  else if (v >= mn)
    b = v * std::ldexp(1.0, -(F::mbits + 1));
  else
    b = dn / 2;
  return b * X * (1 + 1e-6) + 1e-37;
}

}  // namespace qt
