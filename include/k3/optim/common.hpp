// k3/optim/common.hpp — the vocabulary of k3's optimizer ops, shared by every backend: NS5's
// options and arguments, its FLOP count, Moonlight's factor, and the argument checks each
// backend runs before it computes (k3/optim/newton_schulz.hpp on the CPU, k3/optim/cuda.cuh).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "k3/core/storage.hpp"
#include "k3/core/error.hpp"
#include "k3/core/memory_space.hpp"
#include "k3/core/numeric/bfloat16.hpp"
#include "k3/core/tensor_view.hpp"
#include "k3/core/validate.hpp"

namespace k3::optim {

// What multiplies NS5's output: nothing, or Moonlight's 0.2·sqrt(max(A, B)) of the whole
// matrix [A, B] (which makes the update's RMS about that of AdamW's).
enum class muon_scale { none, moonlight };

// The type the iteration runs in: double for double storage and float otherwise, or forced.
enum class compute_precision { automatic, float32, float64 };

struct newton_schulz_options {
  int steps = 5;
  index_t heads = 1;  // row blocks of A / heads rows, each its own iteration (Per-Head Muon)
  muon_scale scale = muon_scale::none;
  double a = 3.4445, b = -4.7750, c = 2.0315;
  double eps = 1e-7;
  compute_precision compute = compute_precision::automatic;
};

// g: the matrix or stack to orthogonalise; o: the result, same shape (o may be g itself).
// Space: where the views live (device views go to a CUDA backend, k3/optim/cuda.cuh).
template <class T, std::size_t Rank = 2, class Space = host_space>
struct newton_schulz_args {
  tensor_view<T const, Rank, Space> g;
  tensor_view<T, Rank, Space> o;
};

// GEMM FLOPs of NS5 on one [rows, cols] block: per step 2m²n (X Xᵀ) + 2m³ (A·A) + 2m²n (B·X),
// m = min(rows, cols), n = max(rows, cols).
inline constexpr double newton_schulz_flops(index_t rows, index_t cols, int steps) noexcept {
  double const m = static_cast<double>(std::min(rows, cols)), n = static_cast<double>(std::max(rows, cols));
  return static_cast<double>(steps) * (4.0 * m * m * n + 2.0 * m * m * m);
}

static_assert(newton_schulz_flops(2, 3, 1) == 4.0 * 4 * 3 + 2.0 * 8);
static_assert(newton_schulz_flops(3, 2, 5) == newton_schulz_flops(2, 3, 5));

// Moonlight's factor 0.2·sqrt(max(A, B)) for a matrix [A, B].
inline double moonlight_factor(index_t rows, index_t cols) noexcept {
  return 0.2 * std::sqrt(static_cast<double>(std::max(rows, cols)));
}

namespace detail {



// A matrix [A, B] as a stack of one [1, A, B]; a stack as it is.
template <class E, std::size_t Rank, class Space>
tensor_view<E, 3, Space> ns_as_stack(tensor_view<E, Rank, Space> const& v) {
  if constexpr (Rank == 2)
    return {v.data_handle(), {1, v.extent(0), v.extent(1)}, {0, v.stride(0), v.stride(1)}};
  else
    return v;
}

inline void check_newton_schulz_options(newton_schulz_options const& opt, index_t rows, std::string const& shape) {
  ::k3::detail::require(opt.steps >= 1, error_kind::value, [&] { return "option 'steps': expected >= 1, got " + std::to_string(opt.steps); });
  ::k3::detail::require(opt.heads >= 1, error_kind::value, [&] { return "option 'heads': expected >= 1, got " + std::to_string(opt.heads); });
  ::k3::detail::require(rows % opt.heads == 0, error_kind::shape, [&] {
    return "option 'heads': " + std::to_string(opt.heads) + " heads do not divide the A = " + std::to_string(rows) + " rows of g " + shape;
  });
  ::k3::detail::require(std::isfinite(opt.eps) && opt.eps >= 0, error_kind::value, [&] { return "option 'eps': expected a finite value >= 0, got " + ::k3::detail::format_number(opt.eps); });
  ::k3::detail::require(std::isfinite(opt.a) && std::isfinite(opt.b) && std::isfinite(opt.c), error_kind::value, "options 'a', 'b', 'c': the coefficients must be finite");
}



// The checks every backend runs first. Returns whether the iteration runs in double.
template <class T, std::size_t Rank, class Space>
bool check_newton_schulz(newton_schulz_args<T, Rank, Space> const& args, newton_schulz_options const& opt) {
  static_assert(Rank == 2 || Rank == 3, "newton_schulz: g and o are [A, B] matrices or [M, A, B] stacks");
  static_assert(k3::Storage<std::remove_const_t<T>>, "newton_schulz: storage must be float, double or k3::bfloat16");
  ::k3::detail::check_view("g", args.g);
  ::k3::detail::check_view("o", args.o);
  ::k3::detail::require(args.o.extents() == args.g.extents(), error_kind::shape, [&] {
    return "argument 'o': expected the shape of g " + ::k3::detail::shape_of(args.g) + ", got " + ::k3::detail::shape_of(args.o);
  });
  ::k3::detail::check_not_broadcast("o", args.o);
  bool const same = static_cast<void const*>(args.o.data_handle()) == static_cast<void const*>(args.g.data_handle()) &&
                    args.o.strides() == args.g.strides();
  if (!same) ::k3::detail::check_no_overlap("o", args.o, "g", args.g);
  check_newton_schulz_options(opt, args.g.extent(Rank - 2), ::k3::detail::shape_of(args.g));
  using S = std::remove_const_t<T>;
  return opt.compute == compute_precision::float64 ||
         (opt.compute == compute_precision::automatic && std::is_same_v<k3::accumulation_t<S>, double>);
}

}  // namespace detail

}  // namespace k3::optim
