// Padded views with permuted dimensions whose padding is checked afterwards (the KDA and DPLR
// tests pass every input and output through one).
#pragma once
#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <vector>

#include "k3/core/numeric/bfloat16.hpp"
#include "k3/core/tensor_view.hpp"

namespace k3::test {

// A padded view with permuted dimensions: `order` lists the dimensions outermost first (the
// last dimension stays innermost, unit stride); every row is `pad` elements longer and the
// padding holds `fill`.
template <class T, std::size_t R>
struct strided {
  std::vector<T> mem;
  tensor_view<T, R> view;
  strided(std::array<index_t, R> ext, std::array<std::size_t, R - 1> order, index_t pad, T fill) {
    std::array<index_t, R> str{};
    str[R - 1] = 1;
    index_t run = ext[R - 1] + pad;
    for (std::size_t i = R - 1; i-- > 0;) {
      str[order[i]] = run;
      run *= std::max<index_t>(ext[order[i]], 1);
    }
    mem.assign(std::size_t(run), fill);
    typename tensor_view<T, R>::extents_type e{}, st{};
    for (std::size_t r = 0; r < R; ++r) e[r] = ext[r], st[r] = str[r];
    view = tensor_view<T, R>(mem.data(), e, st);
  }
  template <class U>
  void set(std::vector<U> const& dense) {
    index_t i = 0;
    for_each_index([&](auto const& ix) { at(ix) = store_as<T>(load_as<double>(dense[std::size_t(i++)])); });
  }
  std::vector<double> get() const {
    std::vector<double> r;
    for_each_index([&](auto const& ix) { r.push_back(load_as<double>(const_cast<strided*>(this)->at(ix))); });
    return r;
  }
  T& at(std::array<index_t, R> const& ix) {
    index_t off = 0;
    for (std::size_t r = 0; r < R; ++r) off += ix[r] * view.stride(r);
    return mem[std::size_t(off)];
  }
  template <class F>
  void for_each_index(F&& f) const {
    index_t total = 1;
    for (std::size_t r = 0; r < R; ++r) total *= view.extent(r);
    std::array<index_t, R> ix{};
    for (index_t n = 0; n < total; ++n) {
      index_t rem = n;
      for (std::size_t r = R; r-- > 0;) {
        ix[r] = rem % view.extent(r);
        rem /= view.extent(r);
      }
      f(ix);
    }
  }
  // Padding entries still hold `fill` (outputs write nothing outside their elements).
  bool padding_is(T fill) const {
    std::vector<char> inside(mem.size(), 0);
    for_each_index([&](auto const& ix) {
      index_t off = 0;
      for (std::size_t r = 0; r < R; ++r) off += ix[r] * view.stride(r);
      inside[std::size_t(off)] = 1;
    });
    for (std::size_t i = 0; i < mem.size(); ++i)
      if (!inside[i] && !(load_as<double>(mem[i]) == load_as<double>(fill))) return false;
    return true;
  }
};

}  // namespace k3::test
