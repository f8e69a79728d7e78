// k3/core/storage.hpp — the element types tensors are stored in and the type k3 accumulates
// them in. Every capability uses these two names; none defines its own.
#pragma once
#include <concepts>
#include <type_traits>

#include "k3/core/numeric/bfloat16.hpp"

namespace k3 {

// Storage types of activations, weights and gradients: float, double or bfloat16.
template <class T>
concept Storage = std::same_as<T, float> || std::same_as<T, double> || std::same_as<T, bfloat16>;

// The accumulation type of a computation over these storage types: double when any of them
// is double, float otherwise (bfloat16 is never accumulated in). Also the default state type
// of KDA and DPLR.
template <class... T>
using accumulation_t = std::conditional_t<(std::is_same_v<std::remove_cv_t<T>, double> || ...), double, float>;

static_assert(std::is_same_v<accumulation_t<bfloat16>, float>);
static_assert(std::is_same_v<accumulation_t<float const, double>, double>);
static_assert(std::is_same_v<accumulation_t<float, bfloat16 const>, float>);

}  // namespace k3
