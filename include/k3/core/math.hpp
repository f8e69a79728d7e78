// k3/core/math.hpp — numerically careful scalar helpers usable on host and device.
#pragma once
#include <cmath>

#include "k3/core/config.hpp"

namespace k3::detail {

template <class T>
K3_INLINE T sigmoid(T x) noexcept {
  // Never exponentiates a large positive number.
  if (x >= T(0)) {
    T e = std::exp(-x);
    return T(1) / (T(1) + e);
  }
  T e = std::exp(x);
  return e / (T(1) + e);
}

template <class T>
K3_INLINE T softplus(T x) noexcept {
  // log(1 + e^x) without overflow: max(x, 0) + log1p(e^-|x|).
  return (x > T(0) ? x : T(0)) + std::log1p(std::exp(-std::fabs(x)));
}

template <class T>
K3_INLINE T silu(T x) noexcept {
  return x * sigmoid(x);
}

// The chunked forms factor a span's decay as e^{G_i - G_j}, G a chunk-local cumsum of log
// decays. A log decay at or below full_decay_log<T>() already has e^g == 0 in T (the floor is
// below the log of half the smallest subnormal), exactly like a hard reset g = -inf; clamping g
// there changes no product, keeps G finite (-inf - -inf would be NaN) and keeps |G| small (the
// rounding of every later difference G_i - G_j grows with |G|). NaN passes through.
template <class T>
K3_INLINE constexpr T full_decay_log() noexcept {
  return sizeof(T) >= 8 ? T(-750) : T(-112);
}

template <class T>
K3_INLINE T clamp_log_decay(T g) noexcept {
  return g < full_decay_log<T>() ? full_decay_log<T>() : g;
}

// Log decays below this one are "large" (a hard reset, a document boundary): the chunked forms
// keep them in a cumsum of their own (core/gate_cumsum.hpp says why). Any threshold would be
// exact; this one leaves smooth gates (and the lower-bounded gate, g >= -5) on the plain path,
// and a factor across a large decay is at most e^{-16} = 1.1e-7, the float epsilon.
template <class T>
K3_INLINE constexpr T split_log_decay() noexcept {
  return T(-16);
}

}  // namespace k3::detail
