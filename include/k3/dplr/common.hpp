// k3/dplr/common.hpp — argument bundles, validation and the sequence list shared by the
// recurrent, chunked, segment-map and context-parallel DPLR paths.
//
// Convention (fla's): S_t = (Diag(exp gk_t) + b_t a_t^T) S_{t-1} + k_t v_t^T,
// o_t = S_t^T (scale * q_t), the state after token t. Token-major q k a b gk [B,T,H,K],
// v and o [B,T,H,V]; states [N,H,K,V] in float for float inputs and double for double.
#pragma once
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "k3/core/error.hpp"
#include "k3/core/float_env.hpp"
#include "k3/core/sequence_offsets.hpp"
#include "k3/core/storage.hpp"
#include "k3/core/tensor_view.hpp"
#include "k3/core/validate.hpp"

namespace k3::dplr {

// The state and every accumulation use double for double inputs and float otherwise.
template <class T>
using state_t = ::k3::accumulation_t<T>;

// chunk (the default): the chunked form on the given backend. recurrent: the token-by-token
// reference, run serially on the calling thread whatever host backend is given.
enum class algorithm { chunk, recurrent };

// How a single sequence (fewer (sequence, head) pairs than threads) uses every core.
enum class sequence_split {
  value_split,   // chunk-parallel intra-chunk work + state columns split across threads
  segment_maps,  // tokens split across threads; segment maps composed by a scan
};

// How the four intra-chunk matrices are formed: factored GEMMs anchored at the chunk start
// (fast, valid while the chunk's total decay stays in exp's range) or pairwise exponentials
// (always safe). automatic picks per chunk for accuracy (factored up to e^200 in double, e^30
// in float); factored forces it wherever it is valid (up to e^700, e^85), pairwise beyond.
enum class intra_form { automatic, factored, pairwise };

struct options {
  algorithm mode = algorithm::chunk;
  std::optional<double> scale = {};  // default K^-1/2
  index_t chunk_size = 64;
  intra_form intra = intra_form::automatic;
  sequence_split long_sequence = sequence_split::value_split;
  // Packed variable-length sequences (B must be 1): one of these, N+1 offsets.
  cu_seqlens_view cu_seqlens = {};  // int32 or int64 offsets, B = 1
};

// Absent optional tensors are default-constructed views (null data, zero extents).
template <class T>
struct forward_args {
  const_view<T, 4> q = {}, k = {}, v = {}, a = {}, b = {}, gk = {};  // [B,T,H,K], v [B,T,H,V]
  const_view<state_t<T>, 4> h0 = {};                                 // [N,H,K,V]; absent = zero
  tensor_view<T, 4> o = {};                                          // [B,T,H,V]
  tensor_view<state_t<T>, 4> ht = {};                                // [N,H,K,V]; absent = not wanted
};

template <class T>
struct backward_args {
  const_view<T, 4> q = {}, k = {}, v = {}, a = {}, b = {}, gk = {};
  const_view<state_t<T>, 4> h0 = {};
  const_view<T, 4> d_o = {};                                      // gradient of o, [B,T,H,V]
  const_view<state_t<T>, 4> dht = {};                             // gradient of ht; absent = zero
  tensor_view<T, 4> dq = {}, dk = {}, dv = {}, da = {}, db = {}, dgk = {};
  tensor_view<state_t<T>, 4> dh0 = {};                            // absent = not wanted
};

}  // namespace k3::dplr

namespace k3 {

namespace detail::dplr {

using ::k3::dplr::algorithm;
using ::k3::dplr::intra_form;
using ::k3::dplr::options;
using ::k3::dplr::sequence_split;
using ::k3::dplr::state_t;

// The token inputs and h0 of any args type, the form every internal path takes.
template <class T>
struct inputs {
  const_view<T, 4> q, k, v, a, b, gk;
  const_view<state_t<T>, 4> h0;
};

template <class Args>
auto inputs_of(Args const& x) {
  using T = typename decltype(x.q)::value_type;
  return inputs<T>{x.q, x.k, x.v, x.a, x.b, x.gk, x.h0};
}


struct sequence {
  index_t batch, bos, eos;
  index_t len() const { return eos - bos; }
};

struct problem {
  index_t B = 0, T = 0, H = 0, K = 0, V = 0, N = 0;
  double scale = 1;
  index_t chunk = 64;
  std::vector<sequence> seqs;
};

inline bool has_varlen(options const& o) { return o.cu_seqlens.present(); }

inline void read_offsets(cu_seqlens_view const& cu, index_t B, index_t T, std::vector<sequence>& seqs) {
  require(cu.size() == 0 || cu.data() != nullptr, error_kind::shape,
          [&] { return "argument 'cu_seqlens': null data for " + std::to_string(cu.size()) + " offsets"; });
  require(B == 1, error_kind::shape, [&] { return "argument 'cu_seqlens': packed sequences need batch size 1, got B = " + std::to_string(B); });
  require(cu.size() >= 1, error_kind::shape, "argument 'cu_seqlens': needs at least one offset (N+1 entries)");
  require(cu[0] == 0, error_kind::value, [&] { return "argument 'cu_seqlens': must start at 0, got " + std::to_string(cu[0]); });
  for (index_t i = 0; i + 1 < cu.size(); ++i) {
    index_t lo = static_cast<index_t>(cu[i]), hi = static_cast<index_t>(cu[i + 1]);
    require(hi >= lo, error_kind::value, [&] {
      return "argument 'cu_seqlens': offsets must be non-decreasing, got " + std::to_string(lo) + " then " + std::to_string(hi) +
             " at index " + std::to_string(i + 1);
    });
    seqs.push_back({0, lo, hi});
  }
  index_t last = static_cast<index_t>(cu[cu.size() - 1]);
  require(last == T, error_kind::value, [&] {
    return "argument 'cu_seqlens': must end at T = " + std::to_string(T) + ", got " + std::to_string(last);
  });
}

template <class T>
problem make_problem(inputs<T> const& in, options const& opt) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>, "k3 dplr: inputs must be float or double");
  problem p;
  check_view("q", in.q);
  p.B = in.q.extent(0);
  p.T = in.q.extent(1);
  p.H = in.q.extent(2);
  p.K = in.q.extent(3);
  check_view("v", in.v);
  p.V = in.v.extent(3);
  check_shape("k", in.k, {p.B, p.T, p.H, p.K});
  check_shape("a", in.a, {p.B, p.T, p.H, p.K});
  check_shape("b", in.b, {p.B, p.T, p.H, p.K});
  check_shape("gk", in.gk, {p.B, p.T, p.H, p.K});
  check_shape("v", in.v, {p.B, p.T, p.H, any_extent});
  for (auto [name, v] : {std::pair<char const*, const_view<T, 4>>{"q", in.q}, {"k", in.k}, {"v", in.v}, {"a", in.a}, {"b", in.b}, {"gk", in.gk}}) {
    check_view(name, v);
    check_inner_contiguous(name, v);
  }
  require(opt.chunk_size >= 1, error_kind::value, [&] { return "option 'chunk_size': must be >= 1, got " + std::to_string(opt.chunk_size); });
  p.chunk = opt.chunk_size;
  p.scale = opt.scale ? *opt.scale : (p.K > 0 ? 1.0 / std::sqrt(double(p.K)) : 1.0);
  require(std::isfinite(p.scale), error_kind::value, [&] { return "option 'scale': must be finite, got " + std::to_string(p.scale); });
  if (opt.cu_seqlens.present()) read_offsets(opt.cu_seqlens, p.B, p.T, p.seqs);
  else
    for (index_t b = 0; b < p.B; ++b) p.seqs.push_back({b, 0, p.T});
  p.N = static_cast<index_t>(p.seqs.size());
  if (k3::present(in.h0)) {
    check_view("h0", in.h0);
    check_shape("h0", in.h0, {p.N, p.H, p.K, p.V});
  }
  return p;
}

// The token inputs q, k, v, a, b, gk (and h0 unless `with_h0` is false) through f(name, view).
template <class T, class F>
void for_each_input(inputs<T> const& in, F&& f, bool with_h0 = true) {
  f("q", in.q);
  f("k", in.k);
  f("v", in.v);
  f("a", in.a);
  f("b", in.b);
  f("gk", in.gk);
  if (with_h0) f("h0", in.h0);
}

// Every output: not broadcast (a stride-0 dimension writes one address for several
// elements, racing between threads), not over an input (ht of an early (sequence, head) is
// stored while later ones still read theirs), not over another output.
template <class T>
void check_outputs(problem const& p, inputs<T> const& in, tensor_view<T, 4> const& o, tensor_view<state_t<T>, 4> const& ht) {
  check_view("o", o);
  check_shape("o", o, {p.B, p.T, p.H, p.V});
  check_inner_contiguous("o", o);
  if (k3::present(ht)) {
    check_view("ht", ht);
    check_shape("ht", ht, {p.N, p.H, p.K, p.V});
  }
  ::k3::detail::check_outputs_apart(
      [&](auto&& f) {
        f("o", o);
        f("ht", ht);
      },
      [&](auto&& f) { for_each_input(in, f); });
}

template <class T>
void check_grads(problem const& p, ::k3::dplr::backward_args<T> const& g) {
  auto const in = inputs_of(g);
  check_view("do", g.d_o);
  check_shape("do", g.d_o, {p.B, p.T, p.H, p.V});
  check_inner_contiguous("do", g.d_o);
  if (k3::present(g.dht)) {
    check_view("dht", g.dht);
    check_shape("dht", g.dht, {p.N, p.H, p.K, p.V});
  }
  std::pair<char const*, tensor_view<T, 4>> outs[] = {{"dq", g.dq}, {"dk", g.dk}, {"dv", g.dv}, {"da", g.da}, {"db", g.db}, {"dgk", g.dgk}};
  for (auto& [name, v] : outs) {
    check_view(name, v);
    check_inner_contiguous(name, v);
    check_shape(name, v, {p.B, p.T, p.H, std::string_view(name) == "dv" ? p.V : p.K});
  }
  if (k3::present(g.dh0)) {
    check_view("dh0", g.dh0);
    check_shape("dh0", g.dh0, {p.N, p.H, p.K, p.V});
  }
  ::k3::detail::check_outputs_apart(
      [&](auto&& f) {
        for (auto& [name, v] : outs) f(name, v);
        f("dh0", g.dh0);
      },
      [&](auto&& f) {
        for_each_input(in, f);
        f("do", g.d_o);
        f("dht", g.dht);
      });
}

// One (sequence, head): [len, D] views of its tokens.
template <class T>
struct head_views {
  const_view<T, 2> q, k, v, a, b, gk;
  index_t len = 0;
};

template <class T, class View>
auto head_slice(View const& x, sequence const& s, index_t h) {
  return x.slice(0, s.batch).slice(1, h).sub(0, s.bos, s.len());
}

template <class T>
head_views<T> head_of(inputs<T> const& in, sequence const& s, index_t h) {
  return {head_slice<T>(in.q, s, h),  head_slice<T>(in.k, s, h), head_slice<T>(in.v, s, h),
          head_slice<T>(in.a, s, h),  head_slice<T>(in.b, s, h), head_slice<T>(in.gk, s, h), s.len()};
}

}  // namespace detail::dplr

namespace dplr {

// Shape of ht (and h0, dht, dh0) for these arguments and options: {N sequences (B, or the
// count cu_seqlens gives), H, K, V}. Checks every input and cu_seqlens first, so a caller can
// size its outputs before it has them. Any args type with q, k, v, a, b, gk and h0.
template <class Args>
std::array<index_t, 4> state_shape(Args const& a, options const& opt = {}) {
  auto const p = detail::dplr::make_problem(detail::dplr::inputs_of(a), opt);
  return {p.N, p.H, p.K, p.V};
}

}  // namespace dplr
}  // namespace k3
