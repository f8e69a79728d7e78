// k3/kda/preprocess/common.hpp — shared plumbing of the KDA pre-processing ops: storage/compute
// type rules, row addressing of strided views, deterministic blocked reductions over a backend,
// and the varlen sequence table.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <xsimd/xsimd.hpp>

#include "k3/backend/cpu/serial.hpp"
#include "k3/backend/cpu/simd.hpp"
#include "k3/core/concepts.hpp"
#include "k3/core/error.hpp"
#include "k3/core/math.hpp"
#include "k3/core/numeric/bfloat16.hpp"
#include "k3/core/tensor_view.hpp"
#include "k3/core/validate.hpp"
#include "k3/kda/common.hpp"

namespace k3::kda {

namespace detail {

template <class V>
using pp_elem_t = std::remove_const_t<typename std::remove_cvref_t<V>::element_type>;

// The accumulation type of the participating views' storage (bfloat16 is widened to fp32 on
// load). An absent optional view has the element type of its args member, which is never
// wider than the required views' types.
template <class... V>
using pp_compute_t = ::k3::accumulation_t<pp_elem_t<V>...>;

// Offset of row r (a linear index over all dimensions but the last) of a strided view.
template <class V>
index_t pp_row_offset(V const& v, index_t r) noexcept {
  index_t off = 0;
  for (std::size_t d = V::rank() - 1; d-- > 0;) {
    index_t const e = v.extent(d);
    off += (r % e) * v.stride(d);
    r /= e;
  }
  return off;
}

// r -> pp_row_offset(v, r), with the divisions skipped when the leading dimensions collapse
// into one stride (every contiguous or row-padded view): a rank-4 row costs three 64-bit
// divisions otherwise, as much as the 128 elements of the row it locates.
template <class V>
auto pp_row_map(V const& v) noexcept {
  bool flat = true;
  index_t rs = 0;
  if constexpr (V::rank() >= 2) {
    rs = v.stride(V::rank() - 2);
    index_t expected = rs;
    for (std::size_t d = V::rank() - 2; d-- > 0;) {
      expected *= v.extent(d + 1);
      if (v.extent(d) > 1 && v.stride(d) != expected) flat = false;
    }
  }
  return [&v, flat, rs](index_t r) noexcept { return flat ? r * rs : pp_row_offset(v, r); };
}

template <class V>
index_t pp_rows(V const& v) noexcept {
  index_t n = 1;
  for (std::size_t d = 0; d + 1 < V::rank(); ++d) n *= v.extent(d);
  return n;
}

template <class V>
std::string pp_shape_list(V const& v) {
  return ::k3::detail::shape_of(v);
}

// Same shape, both checked as views; `b` is an output that must not overlap `a`.
template <class A, class B>
void pp_check_same_shape(std::string_view name_a, A const& a, std::string_view name_b, B const& b) {
  bool ok = true;
  for (std::size_t r = 0; r < A::rank(); ++r) ok = ok && a.extent(r) == b.extent(r);
  if (!ok)
    throw ::k3::error(error_kind::shape, "argument '" + std::string(name_b) + "': expected shape " + pp_shape_list(a) + " (the shape of '" +
                      std::string(name_a) + "'), got " + pp_shape_list(b));
}

// 1 / (1 + e) for e in [0, 1] (or NaN), within an ulp: the hardware's reciprocal estimate and one
// Newton step. A vector division costs about as much as the rest of a sigmoid, and these ops
// can keep up with memory only without it (benchmarks/kda.md has the profile).
template <std::size_t U, class Arch>
[[gnu::always_inline]] inline void pp_recip_1p_n(xsimd::batch<float, Arch> const (&e)[U], xsimd::batch<float, Arch> (&out)[U]) noexcept {
  using batch = xsimd::batch<float, Arch>;
  batch d[U];
  for (std::size_t u = 0; u < U; ++u) d[u] = batch(1.0f) + e[u];
  for (std::size_t u = 0; u < U; ++u) out[u] = xsimd::reciprocal(d[u]);
  for (std::size_t u = 0; u < U; ++u) out[u] = k3::simd::fma(out[u], k3::simd::fnma(d[u], out[u], batch(1.0f)), out[u]);
}

// The float sigmoid of U vectors in place, in k3::detail::sigmoid's form (never exponentiating
// a large positive number; NaN passes through), within an ulp of it. The U chains go step by
// step together (see k3::simd::exp_nonpositive_n); every lane rounds alike whatever U is.
template <std::size_t U, class Arch>
[[gnu::always_inline]] inline void pp_sigmoid_n(xsimd::batch<float, Arch> (&z)[U]) noexcept {
  using batch = xsimd::batch<float, Arch>;
  batch e[U], r[U];
  for (std::size_t u = 0; u < U; ++u) e[u] = -xsimd::abs(z[u]);
  k3::simd::exp_nonpositive_n(e);
  pp_recip_1p_n(e, r);
  for (std::size_t u = 0; u < U; ++u) z[u] = xsimd::select(z[u] >= batch(0.0f), batch(1.0f), e[u]) * r[u];
}
// silu(z) = z sigmoid(z) of U vectors in place.
template <std::size_t U, class Arch>
[[gnu::always_inline]] inline void pp_silu_n(xsimd::batch<float, Arch> (&z)[U]) noexcept {
  xsimd::batch<float, Arch> s[U];
  for (std::size_t u = 0; u < U; ++u) s[u] = z[u];
  pp_sigmoid_n(s);
  for (std::size_t u = 0; u < U; ++u) z[u] = z[u] * s[u];
}
// sigmoid(z) and sigmoid(-z) of U vectors from one exponential each.
template <std::size_t U, class Arch>
[[gnu::always_inline]] inline void pp_sigmoid_pair_n(xsimd::batch<float, Arch> const (&z)[U], xsimd::batch<float, Arch> (&p)[U],
                                                     xsimd::batch<float, Arch> (&m)[U]) noexcept {
  using batch = xsimd::batch<float, Arch>;
  batch e[U], big[U];
  for (std::size_t u = 0; u < U; ++u) e[u] = -xsimd::abs(z[u]);
  k3::simd::exp_nonpositive_n(e);
  pp_recip_1p_n(e, big);
  for (std::size_t u = 0; u < U; ++u) {
    batch const small = e[u] * big[u];
    auto const pos = z[u] >= batch(0.0f);
    p[u] = xsimd::select(pos, big[u], small);
    m[u] = xsimd::select(pos, small, big[u]);
  }
}

// The vectors a row kernel keeps in flight together.
inline constexpr std::size_t pp_unroll = 4;

// p[i] = f(p[i]) over a contiguous float row, f applied in place to an array of U batches (U =
// pp_unroll, or 1 for the last vectors); the tail goes through the same code, zero-padded, so
// every element of every row rounds alike.
template <class Arch, class F>
void pp_float_row(float* p, index_t n, F const& f) noexcept {
  using batch = xsimd::batch<float, Arch>;
  constexpr index_t L = static_cast<index_t>(batch::size);
  constexpr index_t U = static_cast<index_t>(pp_unroll);
  index_t c = 0;
  for (; c + U * L <= n; c += U * L) {
    batch a[pp_unroll];
    for (index_t u = 0; u < U; ++u) a[u] = batch::load_unaligned(p + c + u * L);
    f(a);
    for (index_t u = 0; u < U; ++u) a[u].store_unaligned(p + c + u * L);
  }
  for (; c + L <= n; c += L) {
    batch a[1] = {batch::load_unaligned(p + c)};
    f(a);
    a[0].store_unaligned(p + c);
  }
  if (c < n) {
    alignas(64) float buf[L] = {};
    std::copy(p + c, p + n, buf);
    batch a[1] = {batch::load_aligned(buf)};
    f(a);
    a[0].store_aligned(buf);
    std::copy(buf, buf + (n - c), p + c);
  }
}

// Scratch rows on cache-line boundaries: a 512-bit load that straddles two lines costs two.
template <class T>
using pp_aligned_vector = std::vector<T, xsimd::aligned_allocator<T, 64>>;

// Rows per block of the pre-processing ops' stack buffers.
inline constexpr index_t pp_row_block = 256;

// y = silu(pre) and s = sigmoid(z) in place over a contiguous row. Float uses the vector form
// above: every float path of an op (any layout, the prefill and the decode step) applies the
// same one, so they agree bit for bit. Double keeps the scalar form.
template <class T, class Arch = xsimd::default_arch>
void pp_silu_row(T* p, index_t n) noexcept {
  if constexpr (std::is_same_v<T, float>)
    pp_float_row<Arch>(p, n, [](auto& z) { pp_silu_n(z); });
  else
    for (index_t c = 0; c < n; ++c) p[c] = ::k3::detail::silu(p[c]);
}
template <class T, class Arch = xsimd::default_arch>
void pp_sigmoid_row(T* p, index_t n) noexcept {
  if constexpr (std::is_same_v<T, float>)
    pp_float_row<Arch>(p, n, [](auto& z) { pp_sigmoid_n(z); });
  else
    for (index_t c = 0; c < n; ++c) p[c] = ::k3::detail::sigmoid(p[c]);
}

// sp[i] = sigmoid(z[i]) and sm[i] = sigmoid(-z[i]) over a contiguous row, from one
// exponential each (float: vector registers; double: the scalar k3::detail::sigmoid).
template <class T, class Arch = xsimd::default_arch>
void pp_sigmoid_pair_row(T const* z, T* sp, T* sm, index_t n) noexcept {
  if constexpr (std::is_same_v<T, float>) {
    using batch = xsimd::batch<float, Arch>;
    constexpr index_t L = static_cast<index_t>(batch::size);
    constexpr index_t U = static_cast<index_t>(pp_unroll);
    index_t c = 0;
    for (; c + U * L <= n; c += U * L) {
      batch v[pp_unroll], p[pp_unroll], m[pp_unroll];
      for (index_t u = 0; u < U; ++u) v[u] = batch::load_unaligned(z + c + u * L);
      pp_sigmoid_pair_n(v, p, m);
      for (index_t u = 0; u < U; ++u) {
        p[u].store_unaligned(sp + c + u * L);
        m[u].store_unaligned(sm + c + u * L);
      }
    }
    batch v[1], p[1], m[1];
    for (; c + L <= n; c += L) {
      v[0] = batch::load_unaligned(z + c);
      pp_sigmoid_pair_n(v, p, m);
      p[0].store_unaligned(sp + c);
      m[0].store_unaligned(sm + c);
    }
    if (c < n) {
      alignas(64) float buf[L] = {}, bp[L], bm[L];
      std::copy(z + c, z + n, buf);
      v[0] = batch::load_aligned(buf);
      pp_sigmoid_pair_n(v, p, m);
      p[0].store_aligned(bp);
      m[0].store_aligned(bm);
      std::copy(bp, bp + (n - c), sp + c);
      std::copy(bm, bm + (n - c), sm + c);
    }
  } else {
    for (index_t c = 0; c < n; ++c) {
      sp[c] = ::k3::detail::sigmoid(z[c]);
      sm[c] = ::k3::detail::sigmoid(-z[c]);
    }
  }
}

// sum_i p[i]^2 over a contiguous float row: fused multiply-adds per lane, the lanes reduced in
// a fixed order (one rounding sequence for a given ISA, whatever the row's layout was).
template <class Arch = xsimd::default_arch>
float pp_sum_squares_row(float const* p, index_t n) noexcept {
  using batch = xsimd::batch<float, Arch>;
  constexpr index_t L = static_cast<index_t>(batch::size);
  batch acc(0.0f);
  index_t c = 0;
  for (; c + L <= n; c += L) {
    batch const v = batch::load_unaligned(p + c);
    acc = k3::simd::fma(v, v, acc);
  }
  if (c < n) {
    alignas(64) float buf[L] = {};
    std::copy(p + c, p + n, buf);
    batch const v = batch::load_aligned(buf);
    acc = k3::simd::fma(v, v, acc);
  }
  alignas(64) float lanes[L];
  acc.store_aligned(lanes);
  float s = 0.0f;
  for (index_t i = 0; i < L; ++i) s += lanes[i];
  return s;
}

// sum_i x[i]^2 into ss and sum_i g[i] x[i] into gx over contiguous float rows, with
// pp_sum_squares_row's lanes and order (ss is bit for bit that function's).
template <class Arch = xsimd::default_arch>
void pp_sum_squares_and_dot_row(float const* x, float const* g, index_t n, float& ss, float& gx) noexcept {
  using batch = xsimd::batch<float, Arch>;
  constexpr index_t L = static_cast<index_t>(batch::size);
  batch a(0.0f), b(0.0f);
  index_t c = 0;
  for (; c + L <= n; c += L) {
    batch const v = batch::load_unaligned(x + c);
    a = k3::simd::fma(v, v, a);
    b = k3::simd::fma(batch::load_unaligned(g + c), v, b);
  }
  if (c < n) {
    alignas(64) float bx[L] = {}, bg[L] = {};
    std::copy(x + c, x + n, bx);
    std::copy(g + c, g + n, bg);
    batch const v = batch::load_aligned(bx);
    a = k3::simd::fma(v, v, a);
    b = k3::simd::fma(batch::load_aligned(bg), v, b);
  }
  alignas(64) float la[L], lb[L];
  a.store_aligned(la);
  b.store_aligned(lb);
  ss = 0.0f;
  gx = 0.0f;
  for (index_t i = 0; i < L; ++i) {
    ss += la[i];
    gx += lb[i];
  }
}

// Rows per block of a deterministic reduction: the partition depends only on the problem
// size, never on the thread count, so every backend gives bitwise the same sums.
inline constexpr index_t pp_reduce_block = 256;

// The per-block partial sums part[blocks, width] added in block order: the one summation order
// every backend shares.
inline std::vector<double> pp_sum_blocks(std::vector<double> const& part, index_t blocks, std::size_t width) {
  std::vector<double> out(width, 0.0);
  for (index_t blk = 0; blk < blocks; ++blk)
    for (std::size_t w = 0; w < width; ++w) out[w] += part[static_cast<std::size_t>(blk) * width + w];
  return out;
}

// acc[0..width) = sum over items of what item(i, acc_block) adds, in double. Items are cut
// into fixed blocks run through the backend; blocks are summed in order afterwards.
template <class Backend_, class Item>
std::vector<double> pp_blocked_reduce(Backend_ const& b, index_t items, std::size_t width, Item&& item) {
  index_t const blocks = (items + pp_reduce_block - 1) / pp_reduce_block;
  std::vector<double> part(static_cast<std::size_t>(blocks) * width, 0.0);
  b.for_each(0, blocks, [&](index_t blk) {
    double* acc = part.data() + static_cast<std::size_t>(blk) * width;
    index_t const lo = blk * pp_reduce_block, hi = std::min(items, lo + pp_reduce_block);
    for (index_t i = lo; i < hi; ++i) item(i, acc);
  });
  return pp_sum_blocks(part, blocks, width);
}

// One independent sequence: batch row `b`, tokens [start, start + len).
struct pp_sequence {
  index_t b, start, len;
};

// Sequences of a [B, T, ...] input: one per batch row, or (B == 1) the cu_seqlens segments.
inline std::vector<pp_sequence> pp_sequences(index_t B, index_t T, cu_seqlens_view const& cu_seqlens) {
  std::vector<pp_sequence> seqs;
  if (!cu_seqlens.present()) {
    seqs.reserve(static_cast<std::size_t>(B));
    for (index_t b = 0; b < B; ++b) seqs.push_back({b, 0, T});
    return seqs;
  }
  index_t const n = cu_seqlens.size();
  ::k3::detail::require(n == 0 || cu_seqlens.data() != nullptr, error_kind::value, "argument 'cu_seqlens': null data with a non-empty shape");
  ::k3::detail::require(B == 1, error_kind::shape, [&] { return "argument 'cu_seqlens': needs batch size 1, got B = " + std::to_string(B); });
  ::k3::detail::require(n >= 1, error_kind::shape, "argument 'cu_seqlens': needs at least one entry (0)");
  ::k3::detail::require(cu_seqlens[0] == 0, error_kind::value, [&] {
    return "argument 'cu_seqlens': must start at 0, got " + std::to_string(cu_seqlens[0]);
  });
  for (index_t i = 1; i < n; ++i) {
    index_t const a = cu_seqlens[i - 1], c = cu_seqlens[i];
    ::k3::detail::require(c >= a, error_kind::value, [&] {
      return "argument 'cu_seqlens': must be non-decreasing, got " + std::to_string(a) + " then " + std::to_string(c) +
             " at index " + std::to_string(i);
    });
  }
  index_t const last = cu_seqlens[n - 1];
  ::k3::detail::require(last == T, error_kind::value, [&] {
    return "argument 'cu_seqlens': must end at T = " + std::to_string(T) + ", got " + std::to_string(last);
  });
  seqs.reserve(static_cast<std::size_t>(n - 1));
  for (index_t i = 0; i + 1 < n; ++i) {
    index_t const s = cu_seqlens[i];
    seqs.push_back({0, s, cu_seqlens[i + 1] - s});
  }
  return seqs;
}

// Sequence index of each token position (varlen, B == 1).
inline std::vector<index_t> pp_token_owner(std::vector<pp_sequence> const& seqs, index_t T) {
  std::vector<index_t> own(static_cast<std::size_t>(T), 0);
  for (std::size_t n = 0; n < seqs.size(); ++n)
    for (index_t t = seqs[n].start; t < seqs[n].start + seqs[n].len; ++t) own[static_cast<std::size_t>(t)] = static_cast<index_t>(n);
  return own;
}

}  // namespace detail
}  // namespace k3::kda
