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

}  // namespace k3::detail
