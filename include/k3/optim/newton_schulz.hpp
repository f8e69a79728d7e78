// k3/optim/newton_schulz.hpp — NS5, the quintic Newton–Schulz iteration Muon orthogonalises
// each update matrix with (spec moe_routing.md C.3):
//
//   X = G (transposed if it has more rows than columns, so that X Xᵀ is the small Gram matrix)
//   X = X / (‖X‖_F + eps)
//   repeat steps:  A = X Xᵀ;  B = b·A + c·A·A;  X = a·X + B·X
//   undo the transpose
//
// k3::optim::newton_schulz(backend, newton_schulz_args<T, R>{.g, .o}, options) runs it on one
// matrix [A, B] (R = 2) or a stack [M, A, B] (R = 3); with options.heads = H each matrix is cut
// into H row blocks of A/H rows (Per-Head Muon), each its own iteration and its own norm.
//
// The products are Eigen GEMMs over fixed 256-row panels of each output: threads take whole
// blocks when there are enough of them, panels of one block otherwise, and because the panels
// do not depend on the thread count every backend and thread count gives bitwise the same
// result (the distributed P2P Muon relies on that). NS5(Gᵀ) = NS5(G)ᵀ bit for bit for non-square
// G, where exactly one of the two is transposed internally.
//
// Non-finite input: a block (a matrix, or one head of it) holding NaN or ±Inf comes out as all
// NaN; every other block is computed as if it were absent.
#pragma once
#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include "k3/core/concepts.hpp"
#include "k3/core/error.hpp"
#include "k3/core/numeric/bfloat16.hpp"
#include "k3/core/tensor_view.hpp"
#include "k3/core/validate.hpp"
#include "k3/optim/common.hpp"

namespace k3::optim {

namespace detail {

template <class C>
using ns_matrix = Eigen::Matrix<C, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// Output rows per GEMM task; fixed, so the split (and the rounding) never depends on threads.
inline constexpr index_t ns_panel_rows = 256;

inline index_t ns_panels(index_t rows) noexcept { return (rows + ns_panel_rows - 1) / ns_panel_rows; }


// The iteration's buffers, reused across the blocks one thread runs.
template <class C>
struct ns_workspace {
  ns_matrix<C> x, a, b, y;
};

// Runs panel(p) for p in [0, panels): on the backend's threads, or in order on this one.
template <class Bk, class Panel>
void ns_run_panels(Bk const* b, index_t panels, Panel&& panel) {
  if (b)
    b->for_each(0, panels, [&](std::int64_t p) { panel(static_cast<index_t>(p)); });
  else
    for (index_t p = 0; p < panels; ++p) panel(p);
}

// NS5 of one block g [rows, cols] into o, o = post_scale · NS5(g). `par` (or null: this thread)
// runs the panels of each product.
template <class C, class GIn, class OOut, class Bk>
void ns_block(GIn const& g, OOut const& o, newton_schulz_options const& opt, C post_scale, ns_workspace<C>& w, Bk const* par) {
  using S = std::remove_const_t<typename OOut::element_type>;
  index_t const rows = g.extent(0), cols = g.extent(1);
  if (rows == 0 || cols == 0) return;
  bool const tr = rows > cols;
  index_t const m = tr ? cols : rows, n = tr ? rows : cols;
  w.x.resize(m, n);
  w.a.resize(m, m);
  w.b.resize(m, m);
  w.y.resize(m, n);
  bool finite = true;
  for (index_t i = 0; i < rows; ++i)
    for (index_t j = 0; j < cols; ++j) {
      C const v = load_as<C>(g(i, j));
      finite = finite && std::isfinite(v);
      (tr ? w.x(j, i) : w.x(i, j)) = v;
    }
  if (!finite) {
    for (index_t i = 0; i < rows; ++i)
      for (index_t j = 0; j < cols; ++j) o(i, j) = store_as<S>(std::numeric_limits<C>::quiet_NaN());
    return;
  }
  // The norm's sum of squares in double, in order: the same on every thread count and rank.
  double sq = 0;
  C const* xp = w.x.data();
  for (index_t i = 0; i < m * n; ++i) sq += static_cast<double>(xp[i]) * static_cast<double>(xp[i]);
  C const denom = static_cast<C>(std::sqrt(sq)) + static_cast<C>(opt.eps);
  w.x /= denom;
  C const ca = static_cast<C>(opt.a), cb = static_cast<C>(opt.b), cc = static_cast<C>(opt.c);
  index_t const panels = ns_panels(m);
  for (int s = 0; s < opt.steps; ++s) {
    ns_run_panels(par, panels, [&](index_t p) {
      index_t const r0 = p * ns_panel_rows, nr = std::min(ns_panel_rows, m - r0);
      w.a.middleRows(r0, nr).noalias() = w.x.middleRows(r0, nr) * w.x.transpose();
    });
    ns_run_panels(par, panels, [&](index_t p) {
      index_t const r0 = p * ns_panel_rows, nr = std::min(ns_panel_rows, m - r0);
      w.b.middleRows(r0, nr).noalias() = w.a.middleRows(r0, nr) * w.a;
      w.b.middleRows(r0, nr) = cc * w.b.middleRows(r0, nr) + cb * w.a.middleRows(r0, nr);
    });
    ns_run_panels(par, panels, [&](index_t p) {
      index_t const r0 = p * ns_panel_rows, nr = std::min(ns_panel_rows, m - r0);
      w.y.middleRows(r0, nr).noalias() = w.b.middleRows(r0, nr) * w.x;
      w.y.middleRows(r0, nr) += ca * w.x.middleRows(r0, nr);
    });
    w.x.swap(w.y);
  }
  for (index_t i = 0; i < rows; ++i)
    for (index_t j = 0; j < cols; ++j) o(i, j) = store_as<S>(post_scale * (tr ? w.x(j, i) : w.x(i, j)));
}

template <class C, HostBackend Bk, class T, std::size_t Rank>
void newton_schulz_in(Bk const& b, newton_schulz_args<T, Rank> const& args, newton_schulz_options const& opt) {
  auto const g3 = ns_as_stack(args.g);
  auto const o3 = ns_as_stack(args.o);
  index_t const M = g3.extent(0), A = g3.extent(1), B = g3.extent(2), H = opt.heads, rows = A / H;
  C const post = opt.scale == muon_scale::moonlight ? static_cast<C>(moonlight_factor(A, B)) : C(1);
  index_t const blocks = M * H;
  auto block_view = [&](auto const& v, index_t blk) { return v.slice(0, blk / H).sub(0, (blk % H) * rows, rows); };
  int const conc = static_cast<int>(b.concurrency());
  if (conc <= 1 || blocks >= conc) {
    b.for_each(0, blocks, [&](std::int64_t blk) {
      ns_workspace<C> w;
      ns_block<C>(block_view(g3, blk), block_view(o3, blk), opt, post, w, static_cast<Bk const*>(nullptr));
    });
  } else {
    ns_workspace<C> w;
    for (index_t blk = 0; blk < blocks; ++blk) ns_block<C>(block_view(g3, blk), block_view(o3, blk), opt, post, w, &b);
  }
}

}  // namespace detail

// o = NS5(g) per matrix (and per head block), times the chosen scale.
template <HostBackend Bk, class T, std::size_t Rank>
void newton_schulz(Bk const& b, newton_schulz_args<T, Rank> const& args, newton_schulz_options const& opt = {}) {
  if (detail::check_newton_schulz(args, opt))
    detail::newton_schulz_in<double>(b, args, opt);
  else
    detail::newton_schulz_in<float>(b, args, opt);
}

}  // namespace k3::optim
