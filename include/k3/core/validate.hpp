// k3/core/validate.hpp — argument checks shared by every host entry point. Each throws
// k3::error naming the argument and giving the expected vs actual shape.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>

#include "k3/core/error.hpp"
#include "k3/core/tensor_view.hpp"

namespace k3::detail {

inline constexpr index_t any_extent = -1;

template <class V>
std::string shape_of(V const& v) {
  return format_shape(v.extents());
}

// expected[i] == any_extent matches anything.
template <class V>
void check_shape(std::string_view name, V const& v, std::initializer_list<index_t> expected) {
  bool ok = expected.size() == V::rank();
  std::size_t r = 0;
  for (index_t e : expected) {
    if (!ok) break;
    if (e != any_extent && v.extent(r) != e) ok = false;
    ++r;
  }
  if (!ok) {
    std::string exp = "[";
    bool first = true;
    for (index_t e : expected) {
      if (!first) exp += ", ";
      exp += e == any_extent ? std::string("*") : std::to_string(e);
      first = false;
    }
    exp += "]";
    throw ::k3::error(error_kind::shape, "argument '" + std::string(name) + "': expected shape " + exp + ", got " + shape_of(v));
  }
}

// Data must be present for a non-empty view, strides non-negative.
template <class V>
void check_view(std::string_view name, V const& v) {
  for (std::size_t r = 0; r < V::rank(); ++r) {
    if (v.extent(r) < 0 || v.stride(r) < 0)
      throw ::k3::error(error_kind::shape, "argument '" + std::string(name) + "': negative extent or stride (shape " + shape_of(v) +
                        ", strides " + format_shape(v.strides()) + ")");
  }
  if (v.size() > 0 && v.data_handle() == nullptr)
    throw ::k3::error(error_kind::shape, "argument '" + std::string(name) + "': null data for non-empty shape " + shape_of(v));
}

// The last dimension must be unit-stride (vectorised kernels read rows contiguously).
template <class V>
void check_inner_contiguous(std::string_view name, V const& v) {
  if constexpr (V::rank() > 0) {
    if (v.extent(V::rank() - 1) > 1 && v.stride(V::rank() - 1) != 1)
      throw ::k3::error(error_kind::shape, "argument '" + std::string(name) + "': the last dimension must have stride 1, got strides " +
                        format_shape(v.strides()));
  }
}

// Byte range [first, last) a view can touch; empty views touch nothing.
template <class V>
void byte_range(V const& v, std::uintptr_t& lo, std::uintptr_t& hi) {
  lo = hi = 0;
  if (v.size() == 0) return;
  index_t last = 0;
  for (std::size_t r = 0; r < V::rank(); ++r) last += (v.extent(r) - 1) * v.stride(r);
  lo = reinterpret_cast<std::uintptr_t>(v.data_handle());
  hi = lo + static_cast<std::uintptr_t>(last + 1) * sizeof(typename V::element_type);
}

// An output must not overlap an input (or another output).
template <class A, class B>
void check_no_overlap(std::string_view name_a, A const& a, std::string_view name_b, B const& b) {
  std::uintptr_t a0, a1, b0, b1;
  byte_range(a, a0, a1);
  byte_range(b, b0, b1);
  if (a0 < a1 && b0 < b1 && a0 < b1 && b0 < a1)
    throw ::k3::error(error_kind::aliasing, "arguments '" + std::string(name_a) + "' and '" + std::string(name_b) +
                      "' overlap in memory; outputs must not alias inputs or other outputs");
}

// An output with a stride-0 dimension (a broadcast view) writes several elements to one
// address: the results would depend on the write order (and race between threads).
template <class V>
void check_not_broadcast(std::string_view name, V const& v) {
  if (v.size() == 0) return;  // writes nothing (contiguous empty views have zero outer strides)
  for (std::size_t r = 0; r < V::rank(); ++r)
    if (v.extent(r) > 1 && v.stride(r) == 0)
      throw ::k3::error(error_kind::aliasing, "argument '" + std::string(name) + "': dimension " + std::to_string(r) + " (extent " + std::to_string(v.extent(r)) +
                        ") has stride 0; an output must not alias itself (strides " + format_shape(v.strides()) + ")");
}

// The n elements at p as a flat view (empty when p is null): launchers that take raw pointers
// to contiguous data pass their arguments to check_outputs_apart through it.
template <class Space = host_space, class T>
tensor_view<T, 1, Space> flat_view(T* p, index_t n) {
  return tensor_view<T, 1, Space>(p, {p ? n : 0});
}

// outs(f) and ins(f) call f(name, view) for each output and input. The outputs pairwise, each
// unordered pair once.
template <class Outs>
void check_outputs_disjoint(Outs&& outs) {
  int i = 0;
  outs([&](char const* o1, auto const& v1) {
    int j = 0;
    outs([&](char const* o2, auto const& v2) {
      if (j++ > i) check_no_overlap(o1, v1, o2, v2);
    });
    ++i;
  });
}

// named_views("y", y, "x", x, ...)(f) calls f(name, view) for each pair, in order: the outs and
// ins of check_outputs_apart for a fixed list of views. The views are held by value (they are a
// pointer, extents and strides), so temporaries such as flat_view(...) may be passed.
template <class... A>
auto named_views(A... a) {
  static_assert(sizeof...(A) % 2 == 0, "named_views takes (name, view) pairs");
  return [t = std::tuple<A...>(a...)](auto&& f) {
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      (f(std::get<2 * I>(t), std::get<2 * I + 1>(t)), ...);
    }(std::make_index_sequence<sizeof...(A) / 2>{});
  };
}

// joined(l1, l2, ...)(f) runs each list of named views in turn: one list from several.
template <class... L>
auto joined(L... lists) {
  return [=](auto&& f) { (lists(f), ...); };
}

// Every output neither broadcast nor overlapping an input or another output.
template <class Outs, class Ins>
void check_outputs_apart(Outs&& outs, Ins&& ins) {
  outs([&](char const* on, auto const& ov) { check_not_broadcast(on, ov); });
  outs([&](char const* on, auto const& ov) { ins([&](char const* in, auto const& iv) { check_no_overlap(on, ov, in, iv); }); });
  check_outputs_disjoint(outs);
}

}  // namespace k3::detail
