// k3/kda/preprocess/conv.hpp — the short causal depthwise convolution (+ SiLU) that KDA
// applies to q, k and v before everything else, its backward, and its decode step.
//
// Shapes: x, y [B, T, C]; weight [C, W] (W = 4 in Kimi Linear, any W >= 1 works); bias [C]
// (optional); conv state [N, C, W-1], N = B or the number of cu_seqlens sequences.
//
//   pre[t, c] = bias[c] + sum_{j<W} weight[c, j] * x[t - (W-1) + j, c]
//   y[t, c]   = silu(pre[t, c])   (or pre itself with silu = false)
//
// weight[c, W-1] multiplies the current token (the causal-conv1d convention). Positions
// before a sequence's first token read the initial conv state when one is given
// (state[n, c, i] is position start - (W-1) + i, oldest first), zero otherwise: nothing
// leaks across cu_seqlens boundaries or batch rows. The final conv state holds the last
// W-1 inputs of each sequence (reaching into the initial state for short sequences), so
// decoding token by token after a prefill continues the same convolution.
//
//   short_conv(be, short_conv_args<In, P>{.x, .weight, .bias, .y, .initial_state, .final_state},
//              {.cu_seqlens, .silu})
//   short_conv_backward(be, short_conv_backward_args<In, P>{.x, .weight, .bias, .d_y, .d_x,
//                       .d_weight, .d_bias, .initial_state, .d_initial_state}, options)
//   short_conv_decode(be, short_conv_decode_args<In, P>{.x, .weight, .bias, .conv_state, .y,
//                     .slots32 | .slots64}, {.silu})
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "k3/core/math.hpp"
#include "k3/core/prefetch.hpp"
#include "k3/core/storage.hpp"
#include "k3/kda/preprocess/common.hpp"
#include "k3/kda/preprocess/tuning.hpp"

namespace k3::kda {

// Options of the three conv ops. cu_seqlens: packed sequences (B = 1) for the prefill and its
// backward; the decode step (one token per sequence) refuses it. silu = false leaves y = pre.
struct short_conv_options {
  cu_seqlens_view cu_seqlens = {};
  bool silu = true;
  preprocess_tuning tuning = preprocess_tuning::host();  // the host backends' prefetch and streaming
};

// In: the activations (x, y and their gradients). P: weight, bias and the conv states, which
// may be stored wider than the activations (float parameters with bfloat16 x and y). Space:
// where the views live (host_space for the CPU backends, cuda_device_space for
// k3::cuda::stream_backend, k3/kda/cuda/preprocess_backend.cuh); options stay on the host.
template <Storage In, Storage P = In, class Space = host_space>
struct short_conv_args {
  tensor_view<In const, 3, Space> x;                  // [B, T, C]
  tensor_view<P const, 2, Space> weight;              // [C, W]
  tensor_view<P const, 1, Space> bias = {};           // [C]; absent = 0
  tensor_view<In, 3, Space> y;                        // [B, T, C]
  tensor_view<P const, 3, Space> initial_state = {};  // [N, C, W-1]; absent = zeros
  tensor_view<P, 3, Space> final_state = {};          // [N, C, W-1]; may be initial_state itself (in place)
};

// The final conv state is treated as not differentiated (decode cache).
template <Storage In, Storage P = In, class Space = host_space>
struct short_conv_backward_args {
  tensor_view<In const, 3, Space> x;                  // [B, T, C]
  tensor_view<P const, 2, Space> weight;              // [C, W]
  tensor_view<P const, 1, Space> bias = {};           // [C]
  tensor_view<In const, 3, Space> d_y;                // [B, T, C]
  tensor_view<In, 3, Space> d_x;                      // [B, T, C]
  tensor_view<P, 2, Space> d_weight = {};             // [C, W]; absent = not wanted
  tensor_view<P, 1, Space> d_bias = {};               // [C]; also wanted without a bias (the gradient at 0)
  tensor_view<P const, 3, Space> initial_state = {};  // [N, C, W-1]
  tensor_view<P, 3, Space> d_initial_state = {};      // [N, C, W-1]; needs initial_state
};

// One new token per sequence; conv_state [P, C, W-1] is a pool updated in place. Sequence n
// uses slot slots32[n] or slots64[n] (at most one given; distinct, in [0, P)), or slot n
// without slots (then P >= N).
template <Storage In, Storage P = In, class Space = host_space>
struct short_conv_decode_args {
  tensor_view<In const, 2, Space> x;       // [N, C]
  tensor_view<P const, 2, Space> weight;   // [C, W]
  tensor_view<P const, 1, Space> bias = {};
  tensor_view<P, 3, Space> conv_state;     // [pool, C, W-1]
  tensor_view<In, 2, Space> y;             // [N, C]
  tensor_view<std::int32_t const, 1, Space> slots32 = {};
  tensor_view<std::int64_t const, 1, Space> slots64 = {};
};

namespace detail {

// One tap of the convolution, acc + w * v, as an explicit fused multiply-add. Prefill, the
// backward's recompute and decode all go through it, so they round identically whatever the
// compiler contracts on its own (under -ffp-contract=fast g++ fused every prefill tap but
// only some decode taps: decode after a prefill drifted from the full convolution by an ulp).
template <class T>
inline T pp_tap(T acc, T w, T v) noexcept {
  return std::fma(w, v, acc);
}

// out[c] = act(bias[c] + sum_j wt[j*ldw + c] * x[j*ldx + c]) for c < n, the taps in pp_tap's
// order and roundings with the sum held in registers; act is silu or the identity. The tail
// takes pp_tap and pp_silu_row, which round alike, so every channel gets the same bits. stream:
// out is 64-byte aligned and its whole vectors go around the caches (the caller fences).
template <class Arch = xsimd::default_arch>
void pp_conv_row(float* out, float const* bias, float const* wt, index_t ldw, float const* x, index_t ldx, index_t W, index_t n,
                 bool silu, bool stream = false) noexcept {
  using batch = xsimd::batch<float, Arch>;
  constexpr index_t L = static_cast<index_t>(batch::size);
  constexpr index_t U = static_cast<index_t>(pp_unroll);
  index_t c = 0;
  for (; c + U * L <= n; c += U * L) {
    batch a[pp_unroll];
    for (index_t u = 0; u < U; ++u) a[u] = batch::load_unaligned(bias + c + u * L);
    for (index_t j = 0; j < W; ++j)
      for (index_t u = 0; u < U; ++u)
        a[u] = k3::simd::fma(batch::load_unaligned(wt + j * ldw + c + u * L), batch::load_unaligned(x + j * ldx + c + u * L), a[u]);
    if (silu) pp_silu_n(a);
    if (stream)
      for (index_t u = 0; u < U; ++u) k3::simd::store_stream(out + c + u * L, a[u]);
    else
      for (index_t u = 0; u < U; ++u) a[u].store_unaligned(out + c + u * L);
  }
  for (; c + L <= n; c += L) {
    batch acc[1] = {batch::load_unaligned(bias + c)};
    for (index_t j = 0; j < W; ++j)
      acc[0] = k3::simd::fma(batch::load_unaligned(wt + j * ldw + c), batch::load_unaligned(x + j * ldx + c), acc[0]);
    if (silu) pp_silu_n(acc);
    acc[0].store_unaligned(out + c);
  }
  if (c < n) {
    for (index_t i = c; i < n; ++i) {
      float acc = bias[i];
      for (index_t j = 0; j < W; ++j) acc = pp_tap(acc, wt[j * ldw + i], x[j * ldx + i]);
      out[i] = acc;
    }
    if (silu) pp_silu_row<float, Arch>(out + c, n - c);
  }
}

// The parameter sums of a tile of rows in registers, channel vectors outermost: sums[j * lds + c]
// += d[r * ldd + c] * xr[r][j * ldx + c] (one fused multiply-add, as the scalar path rounds it) for
// every tap j < W and sums[W * lds + c] += d[r * ldd + c], over the rows r < rows with xr[r] (row
// t - (W-1) of x) set, in row order. A row at a time, the same sums cost a load and a store of
// every accumulator per row; here they stay in registers across the tile, up to four taps a pass.
template <index_t G, bool Bias, class Arch>
void pp_conv_tap_group(float* sums, index_t lds, float* bias_sums, float const* d, index_t ldd, float const* const* xr, index_t x_off, index_t ldx,
                       index_t rows, index_t n) noexcept {
  using batch = xsimd::batch<float, Arch>;
  constexpr index_t L = static_cast<index_t>(batch::size);
  constexpr index_t A = G + (Bias ? 1 : 0);
  auto columns = [&]<index_t U>(index_t c) {
    batch a[A][U];
    for (index_t j = 0; j < A; ++j)
      for (index_t u = 0; u < U; ++u) a[j][u] = batch::load_unaligned((j < G ? sums + j * lds : bias_sums) + c + u * L);
    for (index_t r = 0; r < rows; ++r) {
      if (xr[r] == nullptr) continue;
      batch dv[U];
      for (index_t u = 0; u < U; ++u) dv[u] = batch::load_unaligned(d + r * ldd + c + u * L);
      for (index_t j = 0; j < G; ++j)
        for (index_t u = 0; u < U; ++u)
          a[j][u] = k3::simd::fma(dv[u], batch::load_unaligned(xr[r] + x_off + j * ldx + c + u * L), a[j][u]);
      if constexpr (Bias)
        for (index_t u = 0; u < U; ++u) a[G][u] = a[G][u] + dv[u];
    }
    for (index_t j = 0; j < A; ++j)
      for (index_t u = 0; u < U; ++u) a[j][u].store_unaligned((j < G ? sums + j * lds : bias_sums) + c + u * L);
  };
  index_t c = 0;
  for (; c + 2 * L <= n; c += 2 * L) columns.template operator()<2>(c);
  for (; c + L <= n; c += L) columns.template operator()<1>(c);
  for (; c < n; ++c)
    for (index_t r = 0; r < rows; ++r) {
      if (xr[r] == nullptr) continue;
      float const dv = d[r * ldd + c];
      for (index_t j = 0; j < G; ++j) sums[j * lds + c] = std::fma(dv, xr[r][x_off + j * ldx + c], sums[j * lds + c]);
      if constexpr (Bias) bias_sums[c] += dv;
    }
}
template <class Arch = xsimd::default_arch>
void pp_conv_tap_sums(float* sums, index_t lds, float const* d, index_t ldd, float const* const* xr, index_t ldx, index_t rows, index_t n,
                      index_t W) noexcept {
  float* const bias_sums = sums + W * lds;
  for (index_t j0 = 0; j0 < W; j0 += 4) {
    float* const s = sums + j0 * lds;
    index_t const off = j0 * ldx;
    auto group = [&]<index_t G>() {
      if (j0 == 0) pp_conv_tap_group<G, true, Arch>(s, lds, bias_sums, d, ldd, xr, off, ldx, rows, n);
      else pp_conv_tap_group<G, false, Arch>(s, lds, bias_sums, d, ldd, xr, off, ldx, rows, n);
    };
    switch (std::min<index_t>(4, W - j0)) {
      case 1: group.template operator()<1>(); break;
      case 2: group.template operator()<2>(); break;
      case 3: group.template operator()<3>(); break;
      default: group.template operator()<4>(); break;
    }
  }
}

// The filter of C channels, [C, W] with W >= 1, and its optional bias [C]: checked alike by
// prefill and decode. Returns W.
template <class Wt, class Bias>
index_t pp_check_conv_filter(Wt const& weight, Bias const& bias, index_t C) {
  ::k3::detail::check_view("weight", weight);
  ::k3::detail::check_shape("weight", weight, {C, ::k3::detail::any_extent});
  index_t const W = weight.extent(1);
  ::k3::detail::require(W >= 1, error_kind::shape, [&] { return "argument 'weight': the kernel width must be >= 1, got shape " + ::k3::detail::shape_of(weight); });
  if (::k3::present(bias)) {
    ::k3::detail::check_view("bias", bias);
    ::k3::detail::check_shape("bias", bias, {C});
  }
  return W;
}

// Shape checks shared by the prefill forward and backward. Returns the sequence table.
template <class X, class Wt, class Bias, class S0>
std::vector<pp_sequence> pp_check_conv(X const& x, Wt const& weight, Bias const& bias, cu_seqlens_view const& cu_seqlens, S0 const& init) {
  ::k3::detail::check_view("x", x);
  index_t const B = x.extent(0), T = x.extent(1), C = x.extent(2);
  index_t const W = pp_check_conv_filter(weight, bias, C);
  std::vector<pp_sequence> seqs = pp_sequences(B, T, cu_seqlens);
  if (::k3::present(init)) {
    ::k3::detail::check_view("initial_state", init);
    ::k3::detail::check_shape("initial_state", init, {static_cast<index_t>(seqs.size()), C, W - 1});
  }
  return seqs;
}

// Input at position p of sequence n (batch row bb) as compute type T, reading the initial
// state (or zero) before the sequence start.
template <class T, class X, class S0>
inline T pp_conv_in(X const& x, S0 const& init, pp_sequence const& sq, index_t n, index_t W, index_t p, index_t c) {
  if (p >= sq.start) return load_as<T>(x(sq.b, p, c));
  if (init.data_handle() == nullptr) return T(0);  // absent (a present view was checked non-null)
  return load_as<T>(init(n, c, p - sq.start + (W - 1)));
}

template <class T, class Bias>
inline T pp_bias(Bias const& bias, index_t c) {
  return bias.data_handle() == nullptr ? T(0) : load_as<T>(bias(c));
}

// The weight transposed to [W, C] and the bias as a row [C], in T and on cache lines: the
// prefill forward and backward read each tap as a unit-stride row.
template <class T>
struct pp_conv_rows {
  pp_aligned_vector<T> weight, bias;
};
template <class T, class Wt, class Bias>
pp_conv_rows<T> pp_conv_rows_of(Wt const& weight, Bias const& bias, index_t W, index_t C) {
  pp_conv_rows<T> rows{pp_aligned_vector<T>(static_cast<std::size_t>(W * C)), pp_aligned_vector<T>(static_cast<std::size_t>(C))};
  for (index_t c = 0; c < C; ++c) {
    for (index_t j = 0; j < W; ++j) rows.weight[static_cast<std::size_t>(j * C + c)] = load_as<T>(weight(c, j));
    rows.bias[static_cast<std::size_t>(c)] = pp_bias<T>(bias, c);
  }
  return rows;
}

// The very same elements (an in-place update), as opposed to a partial overlap.
template <class A, class B>
bool pp_same_view(A const& a, B const& b) {
  return ::k3::present(a) && ::k3::present(b) && static_cast<void const*>(a.data_handle()) == static_cast<void const*>(b.data_handle()) &&
         a.extents() == b.extents() && a.strides() == b.strides();
}

// What the checks of a prefill call (forward or backward) establish.
struct pp_conv_problem {
  std::vector<pp_sequence> seqs;  // one per batch row, or the cu_seqlens segments
  index_t B = 0, T = 0, C = 0, W = 0;
  bool in_place = false;  // final_state is initial_state itself (forward)
};

// Every check of short_conv, for views in any memory space (no element is read but the host
// cu_seqlens): the host backends and k3::cuda::stream_backend report the same k3::error.
template <class In, class P, class Space>
pp_conv_problem pp_validate_short_conv(short_conv_args<In, P, Space> const& a, short_conv_options const& opt) {
  pp_conv_problem pr;
  pr.seqs = pp_check_conv(a.x, a.weight, a.bias, opt.cu_seqlens, a.initial_state);
  pr.B = a.x.extent(0), pr.T = a.x.extent(1), pr.C = a.x.extent(2), pr.W = a.weight.extent(1);
  ::k3::detail::check_view("y", a.y);
  ::k3::detail::check_shape("y", a.y, {pr.B, pr.T, pr.C});
  if (::k3::present(a.final_state)) {
    ::k3::detail::check_view("final_state", a.final_state);
    ::k3::detail::check_shape("final_state", a.final_state, {static_cast<index_t>(pr.seqs.size()), pr.C, pr.W - 1});
  }
  // final_state may BE initial_state (the in-place update): then initial_state is checked as
  // that output (against y), not as an input it overlaps.
  pr.in_place = pp_same_view(a.initial_state, a.final_state);
  ::k3::detail::check_outputs_apart(
      [&](auto&& f) {
        f("y", a.y);
        f("final_state", a.final_state);
      },
      [&](auto&& f) {
        f("x", a.x);
        f("weight", a.weight);
        f("bias", a.bias);
        if (!pr.in_place) f("initial_state", a.initial_state);
      });
  return pr;
}

// Every check of short_conv_backward, for views in any memory space.
template <class In, class P, class Space>
pp_conv_problem pp_validate_short_conv_backward(short_conv_backward_args<In, P, Space> const& a, short_conv_options const& opt) {
  pp_conv_problem pr;
  pr.seqs = pp_check_conv(a.x, a.weight, a.bias, opt.cu_seqlens, a.initial_state);
  index_t const B = a.x.extent(0), Tn = a.x.extent(1), C = a.x.extent(2), W = a.weight.extent(1);
  index_t const N = static_cast<index_t>(pr.seqs.size());
  pr.B = B, pr.T = Tn, pr.C = C, pr.W = W;
  ::k3::detail::check_view("d_y", a.d_y);
  ::k3::detail::check_shape("d_y", a.d_y, {B, Tn, C});
  ::k3::detail::check_view("d_x", a.d_x);
  ::k3::detail::check_shape("d_x", a.d_x, {B, Tn, C});
  if (::k3::present(a.d_weight)) {
    ::k3::detail::check_view("d_weight", a.d_weight);
    ::k3::detail::check_shape("d_weight", a.d_weight, {C, W});
  }
  if (::k3::present(a.d_bias)) {
    ::k3::detail::check_view("d_bias", a.d_bias);
    ::k3::detail::check_shape("d_bias", a.d_bias, {C});
  }
  if (::k3::present(a.d_initial_state)) {
    ::k3::detail::require(::k3::present(a.initial_state), error_kind::value,
                          "argument 'd_initial_state': needs the initial_state it differentiates");
    ::k3::detail::check_view("d_initial_state", a.d_initial_state);
    ::k3::detail::check_shape("d_initial_state", a.d_initial_state, {N, C, W - 1});
  }
  // Every output: not broadcast, not over an input or another output.
  ::k3::detail::check_outputs_apart(::k3::detail::named_views("d_x", a.d_x, "d_weight", a.d_weight, "d_bias", a.d_bias,
                                                              "d_initial_state", a.d_initial_state),
                                    ::k3::detail::named_views("x", a.x, "weight", a.weight, "bias", a.bias, "d_y", a.d_y,
                                                              "initial_state", a.initial_state));
  return pr;
}

// What the checks of a decode step establish: the pool slot of each sequence.
struct pp_decode_problem {
  index_t N = 0, C = 0, W = 0, pool = 0;
  std::vector<index_t> slot;  // [N]
};

// The slots of a decode call on the host, as indices.
template <class In, class P>
std::vector<index_t> pp_read_slots(short_conv_decode_args<In, P, host_space> const& a) {
  index_t const N = a.x.extent(0);
  std::vector<index_t> s(static_cast<std::size_t>(N));
  for (index_t n = 0; n < N; ++n)
    s[static_cast<std::size_t>(n)] = ::k3::present(a.slots32) ? static_cast<index_t>(a.slots32(n)) : static_cast<index_t>(a.slots64(n));
  return s;
}

// Every check of short_conv_decode, for views in any memory space. read_slots() returns the N
// slot values on the host; it is called only when slots are given and their views passed the
// checks (a device backend copies them back there).
template <class In, class P, class Space, class ReadSlots>
pp_decode_problem pp_validate_short_conv_decode(short_conv_decode_args<In, P, Space> const& a, short_conv_options const& opt,
                                                ReadSlots&& read_slots) {
  auto const& x = a.x;
  auto const& weight = a.weight;
  auto const& bias = a.bias;
  auto const& conv_state = a.conv_state;
  auto const& y = a.y;
  auto const& slots32 = a.slots32;
  auto const& slots64 = a.slots64;
  ::k3::detail::require(!opt.cu_seqlens.present(), error_kind::value, "option 'cu_seqlens': not used by the decode step (one token per sequence)");
  ::k3::detail::check_view("x", x);
  ::k3::detail::check_view("conv_state", conv_state);
  ::k3::detail::check_view("y", y);
  index_t const N = x.extent(0), C = x.extent(1);
  index_t const W = pp_check_conv_filter(weight, bias, C);
  ::k3::detail::check_shape("conv_state", conv_state, {::k3::detail::any_extent, C, W - 1});
  ::k3::detail::check_shape("y", y, {N, C});
  index_t const P_ = conv_state.extent(0);
  bool const has32 = ::k3::present(slots32), has64 = ::k3::present(slots64);
  ::k3::detail::require(!(has32 && has64), error_kind::value, "argument 'slots64': give at most one of slots32 (int32) or slots64 (int64)");
  std::vector<index_t> slot(static_cast<std::size_t>(N));
  if (!has32 && !has64) {
    ::k3::detail::require(P_ >= N, error_kind::shape, [&] {
      return "argument 'conv_state': without slots the pool needs at least N = " + std::to_string(N) + " states, got " +
             ::k3::detail::shape_of(conv_state);
    });
    for (index_t n = 0; n < N; ++n) slot[static_cast<std::size_t>(n)] = n;
  } else {
    char const* const sname = has32 ? "slots32" : "slots64";
    if (has32) {
      ::k3::detail::check_view(sname, slots32);
      ::k3::detail::check_shape(sname, slots32, {N});
    } else {
      ::k3::detail::check_view(sname, slots64);
      ::k3::detail::check_shape(sname, slots64, {N});
    }
    std::vector<index_t> const given = read_slots();
    std::vector<char> used(static_cast<std::size_t>(P_), 0);
    for (index_t n = 0; n < N; ++n) {
      index_t const s = given[static_cast<std::size_t>(n)];
      ::k3::detail::require(s >= 0 && s < P_, error_kind::value, [&] {
        return "argument '" + std::string(sname) + "': slot " + std::to_string(s) + " at index " + std::to_string(n) +
               " is outside the pool [0, " + std::to_string(P_) + ")";
      });
      ::k3::detail::require(!used[static_cast<std::size_t>(s)], error_kind::value, [&] {
        return "argument '" + std::string(sname) + "': slot " + std::to_string(s) + " appears twice (index " + std::to_string(n) + ")";
      });
      used[static_cast<std::size_t>(s)] = 1;
      slot[static_cast<std::size_t>(n)] = s;
    }
  }
  // The pool is updated in place (its own input): a stride-0 dimension would make distinct
  // states (or channels, or taps) one address. y and the pool: not broadcast, not over an
  // input or each other.
  ::k3::detail::check_outputs_apart(::k3::detail::named_views("conv_state", conv_state, "y", y),
                                    ::k3::detail::named_views("x", x, "weight", weight, "bias", bias, "slots32", slots32,
                                                              "slots64", slots64));
  return {N, C, W, P_, std::move(slot)};
}

}  // namespace detail

// Prefill: y = silu(conv(x) + bias); optionally reads an initial conv state and writes the
// final conv state (final_state may be the very same view as initial_state: in-place update).
template <HostBackend Bk, class In, class P, class Space, class = ::k3::detail::reachable<Bk, Space>>
void short_conv(Bk const& b, short_conv_args<In, P, Space> const& a, short_conv_options const& opt = {}) {
  auto const& x = a.x;
  auto const& weight = a.weight;
  auto const& bias = a.bias;
  auto const& y = a.y;
  auto const& initial_state = a.initial_state;
  auto const& final_state = a.final_state;
  using X = std::remove_cvref_t<decltype(x)>;
  using Wt = std::remove_cvref_t<decltype(weight)>;
  using Bias = std::remove_cvref_t<decltype(bias)>;
  using Y = std::remove_cvref_t<decltype(y)>;
  using S0 = std::remove_cvref_t<decltype(initial_state)>;
  using S1 = std::remove_cvref_t<decltype(final_state)>;
  bool const silu = opt.silu;
  auto const pr = detail::pp_validate_short_conv(a, opt);
  auto const& seqs = pr.seqs;
  index_t const B = pr.B, Tn = pr.T, C = pr.C, W = pr.W;
  bool const has_final = ::k3::present(final_state);
  using T = detail::pp_compute_t<X, Wt, Bias, Y, S0, S1>;
  bool const varlen = opt.cu_seqlens.present();
  std::vector<index_t> const own = varlen ? detail::pp_token_owner(seqs, Tn) : std::vector<index_t>{};
  auto const taps = detail::pp_conv_rows_of<T>(weight, bias, W, C);
  auto const& wt = taps.weight;
  auto const& bias_row = taps.bias;
  // Float x with unit-stride channels: the taps of rows whose window lies inside the sequence
  // are whole rows of x, summed in vector registers.
  constexpr bool x_rows = std::is_same_v<T, float> && std::is_same_v<detail::pp_elem_t<X>, float>;
  bool const x_unit = x.stride(2) == 1;
  // Float y with unit-stride channels is its own pre-activation buffer.
  constexpr bool y_rows = std::is_same_v<T, detail::pp_elem_t<Y>>;
  bool const y_unit = y.stride(2) == 1;
  // Tiles of 16 rows by pp_row_block channels: the tile's taps, weights and bias stay in L1
  // (whole rows of K3's 2048-4096 channels would not), only x and y stream from memory.
  constexpr index_t tile_rows = 16;
  index_t const rows = B * Tn;
  index_t const ahead = opt.tuning.prefetch_rows;
  bool const stream = y_rows && y_unit && opt.tuning.stream(static_cast<std::size_t>(rows * C) * sizeof(detail::pp_elem_t<Y>));
  b.for_each(0, (rows + tile_rows - 1) / tile_rows, [&](index_t tile) {
    index_t const r_end = std::min(rows, (tile + 1) * tile_rows);
    for (index_t c0 = 0; c0 < C; c0 += detail::pp_row_block) {
      index_t const nc = std::min(detail::pp_row_block, C - c0);
      for (index_t r = tile * tile_rows; r < r_end; ++r) {
        index_t const bb = r / Tn, t = r % Tn;
        index_t const n = varlen ? own[static_cast<std::size_t>(t)] : bb;
        detail::pp_sequence const& sq = seqs[static_cast<std::size_t>(n)];
        if (ahead > 0 && r + ahead < rows)
          ::k3::detail::prefetch_span_l2(&x((r + ahead) / Tn, (r + ahead) % Tn, c0), static_cast<std::size_t>(nc) * sizeof(detail::pp_elem_t<X>));
        alignas(64) T buffer[detail::pp_row_block];
        T* pre = buffer;
        if constexpr (y_rows)
          if (y_unit) pre = &y(bb, t, c0);
        bool rows_done = false;
        if constexpr (x_rows) {
          if (x_unit && t - (W - 1) >= sq.start) {
            bool const aligned = reinterpret_cast<std::uintptr_t>(pre) % 64 == 0;
            detail::pp_conv_row(pre, bias_row.data() + c0, wt.data() + c0, C, &x(bb, t - (W - 1), c0), x.stride(1), W, nc, silu,
                                stream && aligned && pre != buffer);
            rows_done = true;
          }
        }
        if (!rows_done) {
          std::copy(bias_row.data() + c0, bias_row.data() + c0 + nc, pre);
          for (index_t c = 0; c < nc; ++c)
            for (index_t j = 0; j < W; ++j)
              pre[c] = detail::pp_tap(pre[c], wt[static_cast<std::size_t>(j * C + c0 + c)],
                                      detail::pp_conv_in<T>(x, initial_state, sq, n, W, t - (W - 1) + j, c0 + c));
          if (silu) detail::pp_silu_row(pre, nc);
        }
        if (pre == buffer)
          for (index_t c = 0; c < nc; ++c) y(bb, t, c0 + c) = store_as<detail::pp_elem_t<Y>>(pre[c]);
      }
    }
    if (stream) k3::simd::stream_fence<xsimd::default_arch>();
  });
  if (has_final) {
    // Ascending i reads index i + len >= i of the initial state: safe when updating in place.
    b.for_each(0, static_cast<index_t>(seqs.size()), [&](index_t n) {
      detail::pp_sequence const& sq = seqs[static_cast<std::size_t>(n)];
      for (index_t c = 0; c < C; ++c)
        for (index_t i = 0; i < W - 1; ++i)
          final_state(n, c, i) = store_as<detail::pp_elem_t<S1>>(
              detail::pp_conv_in<T>(x, initial_state, sq, n, W, sq.start + sq.len - (W - 1) + i, c));
    });
  }
}

// Backward of short_conv with respect to x, weight, bias and (optionally) the initial conv
// state, from d_y.
template <HostBackend Bk, class In, class P, class Space, class = ::k3::detail::reachable<Bk, Space>>
void short_conv_backward(Bk const& b, short_conv_backward_args<In, P, Space> const& a, short_conv_options const& opt = {}) {
  auto const& x = a.x;
  auto const& weight = a.weight;
  auto const& bias = a.bias;
  auto const& dy = a.d_y;
  auto const& dx = a.d_x;
  auto const& dweight = a.d_weight;
  auto const& dbias = a.d_bias;
  auto const& initial_state = a.initial_state;
  auto const& d_initial_state = a.d_initial_state;
  using X = std::remove_cvref_t<decltype(x)>;
  using Wt = std::remove_cvref_t<decltype(weight)>;
  using Bias = std::remove_cvref_t<decltype(bias)>;
  using DY = std::remove_cvref_t<decltype(dy)>;
  using DX = std::remove_cvref_t<decltype(dx)>;
  using DW = std::remove_cvref_t<decltype(dweight)>;
  using DB = std::remove_cvref_t<decltype(dbias)>;
  using S0 = std::remove_cvref_t<decltype(initial_state)>;
  using DS0 = std::remove_cvref_t<decltype(d_initial_state)>;
  bool const silu = opt.silu;
  auto const pr = detail::pp_validate_short_conv_backward(a, opt);
  auto const& seqs = pr.seqs;
  index_t const B = pr.B, Tn = pr.T, C = pr.C, W = pr.W;
  index_t const N = static_cast<index_t>(seqs.size());
  bool const has_dw = ::k3::present(dweight), has_db = ::k3::present(dbias), has_ds0 = ::k3::present(d_initial_state);
  using T = detail::pp_compute_t<X, Wt, Bias, DY, DX, DW, DB, S0, DS0>;
  bool const varlen = opt.cu_seqlens.present();
  std::vector<index_t> const own = varlen ? detail::pp_token_owner(seqs, Tn) : std::vector<index_t>{};
  auto seq_of = [&](index_t bb, index_t t) { return varlen ? own[static_cast<std::size_t>(t)] : bb; };

  auto const taps = detail::pp_conv_rows_of<T>(weight, bias, W, C);
  auto const& wt = taps.weight;
  auto const& bias_row = taps.bias;
  constexpr bool x_rows = std::is_same_v<T, float> && std::is_same_v<detail::pp_elem_t<X>, float>;
  bool const x_unit = x.stride(2) == 1;

  // One pass over tiles of rows x channels: dpre = dy * silu'(pre) (pre recomputed with the
  // forward's taps) for the tile and the W-1 rows after it, then dx and the parameter sums of the
  // tile's rows. dpre never leaves the cache; only x, dy and dx cross memory.
  constexpr bool dx_rows = std::is_same_v<T, float> && std::is_same_v<T, detail::pp_elem_t<DX>>;
  bool const dx_unit = dx.stride(2) == 1;
  bool const want_sums = has_dw || has_db;
  bool const want_head = has_ds0;
  index_t const rows = B * Tn;
  // The reduction partition (pp_reduce_block rows) depends only on the problem size: every
  // backend sums dweight and dbias in the same order.
  index_t const blocks = (rows + detail::pp_reduce_block - 1) / detail::pp_reduce_block;
  std::size_t const width = want_sums ? static_cast<std::size_t>(C * W + C) : 0;
  std::vector<double> part(static_cast<std::size_t>(blocks) * width, 0.0);
  // dpre of the first W-1 tokens of each sequence, [N, W-1, C], for d_initial_state.
  std::vector<T> head(want_head ? static_cast<std::size_t>(N * (W - 1) * C) : 0);
  constexpr index_t sub = 64, cb = detail::pp_row_block;  // rows and channels per tile

  // dpre of flattened row u, channels [c0, c0 + nc), into d.
  auto dpre_row = [&](index_t u, index_t c0, index_t nc, T* d) {
    index_t const bb = u / Tn, t = u % Tn, n = seq_of(bb, t);
    detail::pp_sequence const& sq = seqs[static_cast<std::size_t>(n)];
    if (!silu) {
      for (index_t c = 0; c < nc; ++c) d[c] = load_as<T>(dy(bb, t, c0 + c));
      return;
    }
    bool rows_done = false;
    if constexpr (x_rows) {
      if (x_unit && t - (W - 1) >= sq.start) {
        detail::pp_conv_row(d, bias_row.data() + c0, wt.data() + c0, C, &x(bb, t - (W - 1), c0), x.stride(1), W, nc, false);
        rows_done = true;
      }
    }
    if (!rows_done)
      for (index_t c = 0; c < nc; ++c) {
        T acc = bias_row[static_cast<std::size_t>(c0 + c)];
        for (index_t j = 0; j < W; ++j)
          acc = detail::pp_tap(acc, wt[static_cast<std::size_t>(j * C + c0 + c)],
                               detail::pp_conv_in<T>(x, initial_state, sq, n, W, t - (W - 1) + j, c0 + c));
        d[c] = acc;
      }
    // silu'(z) = s (1 + z (1 - s)), with 1 - s = sigmoid(-z) (no cancellation).
    alignas(64) T sp[cb], sm[cb];
    detail::pp_sigmoid_pair_row(d, sp, sm, nc);
    for (index_t c = 0; c < nc; ++c) d[c] = load_as<T>(dy(bb, t, c0 + c)) * (sp[c] * (T(1) + d[c] * sm[c]));
  };

  b.for_each(0, blocks, [&](index_t blk) {
    index_t const lo = blk * detail::pp_reduce_block, hi = std::min(rows, lo + detail::pp_reduce_block);
    detail::pp_aligned_vector<T> tile(static_cast<std::size_t>((sub + W - 1) * cb));
    // The parameter sums of one tile in T, [W + 1, cb], added to the block's double sums once per
    // tile: a double per product and tap cost more than the rest of the backward together.
    detail::pp_aligned_vector<T> tile_sums(want_sums ? static_cast<std::size_t>((W + 1) * cb) : 0);
    double* acc = want_sums ? part.data() + static_cast<std::size_t>(blk) * width : nullptr;
    for (index_t c0 = 0; c0 < C; c0 += cb) {
      index_t const nc = std::min(cb, C - c0);
      for (index_t r0 = lo; r0 < hi; r0 += sub) {
        index_t const r1 = std::min(hi, r0 + sub), u1 = std::min(rows, r1 + W - 1);
        for (index_t u = r0; u < u1; ++u) dpre_row(u, c0, nc, tile.data() + (u - r0) * cb);
        std::fill(tile_sums.begin(), tile_sums.end(), T(0));
        // Rows whose taps are whole rows of x (row t - (W-1) here) for the register-tiled sums.
        T const* tap_rows[sub] = {};
        bool any_tap_rows = false;
        for (index_t r = r0; r < r1; ++r) {
          index_t const bb = r / Tn, t = r % Tn, n = seq_of(bb, t);
          detail::pp_sequence const& sq = seqs[static_cast<std::size_t>(n)];
          index_t const end = sq.start + sq.len;
          T const* d = tile.data() + (r - r0) * cb;
          // dx[t] = sum_j weight[j] * dpre[t + (W-1) - j] over outputs inside the sequence.
          bool dx_done = false;
          if constexpr (dx_rows) {
            if (dx_unit && t + (W - 1) < end) {
              static constexpr T zero[cb] = {};
              detail::pp_conv_row(&dx(bb, t, c0), zero, wt.data() + c0, C, d + (W - 1) * cb, -cb, W, nc, false);
              dx_done = true;
            }
          }
          if (!dx_done)
            for (index_t c = 0; c < nc; ++c) {
              T a = 0;
              for (index_t j = 0; j < W; ++j)
                if (t + (W - 1) - j < end) a = detail::pp_tap(a, wt[static_cast<std::size_t>(j * C + c0 + c)], d[(W - 1 - j) * cb + c]);
              dx(bb, t, c0 + c) = store_as<detail::pp_elem_t<DX>>(a);
            }
          // dweight[c, j] += dpre[t, c] * in[t - (W-1) + j, c]; dbias[c] += dpre[t, c]; laid out
          // [W, C] then [C] so that a row adds to contiguous lanes.
          if (want_sums) {
            bool sums_done = false;
            if constexpr (x_rows) {
              if (x_unit && t - (W - 1) >= sq.start) {
                tap_rows[r - r0] = &x(bb, t - (W - 1), c0);
                any_tap_rows = true;
                sums_done = true;
              }
            }
            if (!sums_done) {
              for (index_t j = 0; j < W; ++j)
                for (index_t c = 0; c < nc; ++c)
                  tile_sums[static_cast<std::size_t>(j * cb + c)] = std::fma(
                      d[c], detail::pp_conv_in<T>(x, initial_state, sq, n, W, t - (W - 1) + j, c0 + c), tile_sums[static_cast<std::size_t>(j * cb + c)]);
              T* sb = tile_sums.data() + W * cb;
              for (index_t c = 0; c < nc; ++c) sb[c] += d[c];
            }
          }
          if (want_head) {
            if (t - sq.start < W - 1)
              std::copy(d, d + nc, head.data() + ((n * (W - 1) + (t - sq.start)) * C + c0));
          }
        }
        if constexpr (x_rows) {
          if (any_tap_rows) detail::pp_conv_tap_sums(tile_sums.data(), cb, tile.data(), cb, tap_rows, x.stride(1), r1 - r0, nc, W);
        }
        if (want_sums)
          for (index_t j = 0; j <= W; ++j)
            for (index_t c = 0; c < nc; ++c) acc[j * C + c0 + c] += static_cast<double>(tile_sums[static_cast<std::size_t>(j * cb + c)]);
      }
    }
  });
  if (want_sums) {
    std::vector<double> const sums = detail::pp_sum_blocks(part, blocks, width);
    if (has_dw)
      for (index_t c = 0; c < C; ++c)
        for (index_t j = 0; j < W; ++j) dweight(c, j) = store_as<detail::pp_elem_t<DW>>(sums[static_cast<std::size_t>(j * C + c)]);
    if (has_db)
      for (index_t c = 0; c < C; ++c) dbias(c) = store_as<detail::pp_elem_t<DB>>(sums[static_cast<std::size_t>(W * C + c)]);
  }

  // 4. The initial state's slot i is position start - (W-1) + i; it feeds outputs
  //    start + i - j for j <= i that lie inside the sequence.
  if (has_ds0) {
    b.for_each(0, N, [&](index_t n) {
      detail::pp_sequence const& sq = seqs[static_cast<std::size_t>(n)];
      for (index_t c = 0; c < C; ++c)
        for (index_t i = 0; i < W - 1; ++i) {
          T acc = 0;
          for (index_t j = 0; j <= i; ++j) {
            index_t const to = i - j;  // offset of the output inside the sequence
            if (to < sq.len) acc += load_as<T>(weight(c, j)) * head[static_cast<std::size_t>((n * (W - 1) + to) * C + c)];
          }
          d_initial_state(n, c, i) = store_as<detail::pp_elem_t<DS0>>(acc);
        }
    });
  }
}

// Decode: one new token per sequence (see short_conv_decode_args).
template <HostBackend Bk, class In, class P, class Space, class = ::k3::detail::reachable<Bk, Space>>
void short_conv_decode(Bk const& b, short_conv_decode_args<In, P, Space> const& a, short_conv_options const& opt = {}) {
  auto const& x = a.x;
  auto const& weight = a.weight;
  auto const& bias = a.bias;
  auto const& conv_state = a.conv_state;
  auto const& y = a.y;
  using X = std::remove_cvref_t<decltype(x)>;
  using Wt = std::remove_cvref_t<decltype(weight)>;
  using Bias = std::remove_cvref_t<decltype(bias)>;
  using St = std::remove_cvref_t<decltype(conv_state)>;
  using Y = std::remove_cvref_t<decltype(y)>;
  bool const silu = opt.silu;
  auto const pr = detail::pp_validate_short_conv_decode(a, opt, [&] { return detail::pp_read_slots(a); });
  index_t const N = pr.N, C = pr.C, W = pr.W;
  std::vector<index_t> const& slot = pr.slot;
  using T = detail::pp_compute_t<X, Wt, Bias, St, Y>;
  using SS = detail::pp_elem_t<St>;
  b.for_each(0, N, [&](index_t n) {
    index_t const s = slot[static_cast<std::size_t>(n)];
    T pre[detail::pp_row_block];
    for (index_t c0 = 0; c0 < C; c0 += detail::pp_row_block) {
      index_t const nc = std::min(detail::pp_row_block, C - c0);
      for (index_t c = c0; c < c0 + nc; ++c) {
        T const xv = load_as<T>(x(n, c));
        // The same taps (pp_tap) in the same order, and the same activation (pp_silu_row), as
        // the prefill: decode continues it exactly.
        T acc = detail::pp_bias<T>(bias, c);
        for (index_t j = 0; j + 1 < W; ++j) acc = detail::pp_tap(acc, load_as<T>(weight(c, j)), load_as<T>(conv_state(s, c, j)));
        pre[c - c0] = detail::pp_tap(acc, load_as<T>(weight(c, W - 1)), xv);
        for (index_t j = 0; j + 2 < W; ++j) conv_state(s, c, j) = conv_state(s, c, j + 1);
        if (W > 1) conv_state(s, c, W - 2) = store_as<SS>(xv);
      }
      if (silu) detail::pp_silu_row(pre, nc);
      for (index_t c = 0; c < nc; ++c) y(n, c0 + c) = store_as<detail::pp_elem_t<Y>>(pre[c]);
    }
  });
}

}  // namespace k3::kda
