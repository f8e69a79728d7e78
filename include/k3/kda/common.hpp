// k3/kda/common.hpp — KDA argument bundles, options, validation and the sequence map shared
// by the serial reference, the chunked form and the decode step.
//
// Conventions are fla's (token-major): q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K] natural-log
// per-channel decay; beta [B,T,HV]; states [N,HV,K,V] in the state type S (float, or double
// when computing in double). Value head hv reads q/k head hv / (HV/H).
#pragma once
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "k3/core/error.hpp"
#include "k3/core/prefetch.hpp"
#include "k3/core/sequence_offsets.hpp"
#include "k3/core/storage.hpp"
#include "k3/core/numeric/bfloat16.hpp"
#include "k3/core/tensor_view.hpp"
#include "k3/core/validate.hpp"

namespace k3::kda {


// automatic (the default) is the fastest correct form for the call: on the host backends the
// recurrence for a forward that keeps no saved states (the chunked forward runs at 0.6-0.7x its
// speed there, benchmarks/kda.md), the chunked form for a forward that fills forward_args::saved
// and for the backward. chosen_form says what it resolves to.
enum class algorithm { automatic, chunk, recurrent };

// Sequence offsets are the one core type (k3/core/sequence_offsets.hpp).
using ::k3::cu_seqlens_view;


struct options {
  algorithm mode = algorithm::automatic;
  std::optional<double> scale = {};  // default K^-1/2; multiplies q only
  // When set (in [-5, 0)), every g must be >= it: the chunked form then evaluates its 16x16
  // diagonal tiles as dense products (the bound keeps both exponential factors < e^40).
  // Without it the diagonal tiles are evaluated pair by pair, exact for any gate.
  std::optional<double> gate_lower_bound = {};
  cu_seqlens_view cu_seqlens = {};
};


// The views live in `Space`: host_space for the CPU backends, cuda_device_space for
// k3::cuda::stream_backend (k3/kda/cuda/backend.cuh). Options and cu_seqlens stay on the host.
template <Storage In, class S = k3::accumulation_t<In>, class Space = host_space>
struct forward_args {
  tensor_view<In const, 4, Space> q, k, v, g;
  tensor_view<In const, 3, Space> beta;
  tensor_view<In, 4, Space> o;
  tensor_view<S const, 4, Space> h0 = {};  // optional initial state [N,HV,K,V]
  tensor_view<S, 4, Space> ht = {};        // optional final state [N,HV,K,V]
  // Optional, chunked form only: what the backward needs per chunk (see saved_shape), so that
  // backward_args::saved can skip recomputing the forward's state recurrence.
  tensor_view<S, 3, Space> saved = {};
};

template <Storage In, class S = k3::accumulation_t<In>, class Space = host_space>
struct backward_args {
  tensor_view<In const, 4, Space> q, k, v, g;
  tensor_view<In const, 3, Space> beta;
  tensor_view<S const, 4, Space> h0 = {};
  tensor_view<In const, 4, Space> d_o;      // gradient of o
  tensor_view<S const, 4, Space> dht = {};  // optional gradient of the final state
  tensor_view<In, 4, Space> dq, dk, dv, dg;
  tensor_view<In, 3, Space> dbeta;
  tensor_view<S, 4, Space> dh0 = {};  // optional
  // Optional: forward_args::saved as filled by a chunked forward on the SAME inputs (q, k, v,
  // g, beta, h0) and options (any CPU backend). Only its shape can be checked here; contents
  // from other inputs give wrong gradients. Absent: the backward recomputes the states.
  tensor_view<S const, 3, Space> saved = {};
};

// One decode step for N independent sequences whose states live in a pool, addressed by slot.
template <Storage In, class S = k3::accumulation_t<In>, class Space = host_space>
struct decode_args {
  tensor_view<In const, 3, Space> q, k;  // [N,H,K]
  tensor_view<In const, 3, Space> v;     // [N,HV,V]
  tensor_view<In const, 3, Space> g;     // [N,HV,K]
  tensor_view<In const, 2, Space> beta;  // [N,HV]
  tensor_view<In, 3, Space> o;           // [N,HV,V]
  tensor_view<S, 4, Space> state_pool;   // [P,HV,K,V], updated in place
  // Exactly one of slots32 / slots64: the pool slot of each sequence; a negative slot marks
  // a padding entry, skipped (its o is left untouched), on every backend.
  tensor_view<std::int32_t const, 1, Space> slots32 = {};
  tensor_view<std::int64_t const, 1, Space> slots64 = {};
};

namespace detail {

using k3::detail::prefetch_l2;  // k3/core/prefetch.hpp

inline constexpr index_t chunk_size = 64;
inline constexpr index_t sub_chunk = 16;

// Per-chunk record of the saved states (Vw columns: V in the public tensor, the padded V in
// the simd backward's own buffer): the chunk-start state S (K x Vw), Aqk, KK, A (C x C each),
// R = V - (K e^G) S and U (C x Vw each), all row-major; rows past a short chunk's end unused.
struct saved_layout {
  index_t K, Vw;
  index_t S() const noexcept { return 0; }
  index_t Aqk() const noexcept { return K * Vw; }
  index_t KK() const noexcept { return Aqk() + chunk_size * chunk_size; }
  index_t A() const noexcept { return KK() + chunk_size * chunk_size; }
  index_t R() const noexcept { return A() + chunk_size * chunk_size; }
  index_t U() const noexcept { return R() + chunk_size * Vw; }
  index_t per() const noexcept { return U() + chunk_size * Vw; }
};

using ::k3::detail::check_inner_contiguous;
using ::k3::detail::check_no_overlap;
using ::k3::detail::check_not_broadcast;
using ::k3::detail::check_outputs_apart;
using ::k3::detail::check_shape;
using ::k3::detail::check_view;

// Problem dimensions and the sequence map: sequence n covers tokens [bos(n), eos(n)) of
// batch row batch(n).
struct problem {
  index_t B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0, N = 0, G = 1;
  double scale = 1;
  bool varlen = false;
  std::vector<index_t> offsets;  // N+1 when varlen
  std::optional<double> lower_bound = {};

  index_t batch(index_t n) const noexcept { return varlen ? 0 : n; }
  index_t bos(index_t n) const noexcept { return varlen ? offsets[std::size_t(n)] : 0; }
  index_t eos(index_t n) const noexcept { return varlen ? offsets[std::size_t(n) + 1] : T; }
  index_t chunks(index_t n) const noexcept { return (eos(n) - bos(n) + chunk_size - 1) / chunk_size; }
  // Index of sequence n's first chunk among all sequences' chunks (the saved states' rows).
  std::vector<index_t> chunk_offsets;  // N+1 when varlen
  index_t first_chunk(index_t n) const noexcept { return varlen ? chunk_offsets[std::size_t(n)] : n * chunks(0); }
  index_t total_chunks() const noexcept { return first_chunk(N); }
};

template <class V>
void check_input(char const* name, V const& v, std::initializer_list<index_t> shape) {
  check_view(name, v);
  check_shape(name, v, shape);
  check_inner_contiguous(name, v);
}

template <class V>
void check_optional(char const* name, V const& v, std::initializer_list<index_t> shape) {
  if (!present(v)) return;
  check_input(name, v, shape);
}

inline std::string fmt(double x) { return ::k3::detail::format_number(x); }

inline std::optional<double> checked_lower_bound(options const& opt) {
  if (opt.gate_lower_bound) {
    double const lb = *opt.gate_lower_bound;
    ::k3::detail::require(lb >= -5.0 && lb < 0.0, error_kind::value,
                          [&] { return "option 'gate_lower_bound': expected a value in [-5, 0), got " + fmt(lb); });
  }
  return opt.gate_lower_bound;
}

template <class In, class Space>
problem make_problem(tensor_view<In const, 4, Space> q, tensor_view<In const, 4, Space> v, options const& opt) {
  problem p;
  check_view("q", q);
  check_view("v", v);
  p.B = q.extent(0);
  p.T = q.extent(1);
  p.H = q.extent(2);
  p.K = q.extent(3);
  p.HV = v.extent(2);
  p.V = v.extent(3);
  ::k3::detail::require(p.H >= 1, error_kind::shape, [&] { return "argument 'q': expected at least one head, got shape " + ::k3::detail::shape_of(q); });
  ::k3::detail::require(p.HV >= 1 && p.HV % p.H == 0, error_kind::shape, [&] {
    return "argument 'v': the number of value heads HV (" + std::to_string(p.HV) + ") must be a positive multiple of the q/k heads H (" +
           std::to_string(p.H) + ")";
  });
  p.G = p.HV / p.H;
  double const sc = opt.scale ? *opt.scale : (p.K > 0 ? 1.0 / std::sqrt(double(p.K)) : 1.0);
  ::k3::detail::require(std::isfinite(sc), error_kind::value, [&] { return "option 'scale': must be finite, got " + fmt(sc); });
  p.scale = sc;
  p.lower_bound = checked_lower_bound(opt);
  auto const& cs = opt.cu_seqlens;
  if (cs.present()) {
    p.varlen = true;
    ::k3::detail::require(p.B == 1, error_kind::shape, [&] {
      return "argument 'cu_seqlens': packed sequences need batch size B = 1, got q of shape " + ::k3::detail::shape_of(q);
    });
    ::k3::detail::require(cs.size() == 0 || cs.data() != nullptr, error_kind::shape,
                          [&] { return "argument 'cu_seqlens': null data for " + std::to_string(cs.size()) + " offsets"; });
    ::k3::detail::require(cs.size() >= 1, error_kind::shape, "argument 'cu_seqlens': expected at least one offset (N+1 values), got 0");
    p.N = cs.size() - 1;
    p.offsets.resize(std::size_t(cs.size()));
    for (index_t i = 0; i < cs.size(); ++i) p.offsets[std::size_t(i)] = cs[i];
    ::k3::detail::require(p.offsets.front() == 0, error_kind::value, [&] {
      return "argument 'cu_seqlens': expected the first offset to be 0, got " + std::to_string(p.offsets.front());
    });
    for (index_t i = 1; i < cs.size(); ++i)
      ::k3::detail::require(p.offsets[std::size_t(i)] >= p.offsets[std::size_t(i - 1)], error_kind::value, [&] {
        return "argument 'cu_seqlens': offsets must be non-decreasing, got " + std::to_string(p.offsets[std::size_t(i - 1)]) +
               " then " + std::to_string(p.offsets[std::size_t(i)]) + " at index " + std::to_string(i);
      });
    ::k3::detail::require(p.offsets.back() == p.T, error_kind::value, [&] {
      return "argument 'cu_seqlens': expected the last offset to equal T = " + std::to_string(p.T) + ", got " +
             std::to_string(p.offsets.back());
    });
    p.chunk_offsets.assign(std::size_t(p.N) + 1, 0);
    for (index_t n = 0; n < p.N; ++n) p.chunk_offsets[std::size_t(n) + 1] = p.chunk_offsets[std::size_t(n)] + p.chunks(n);
  } else {
    p.N = p.B;
  }
  return p;
}

// Fast scan of one row of g (vectorisable: no early exit, float compares for float input):
// true when some g may be below the bound; the exact test of check_gate_bound can only fail
// for a value below lb rounded to float.
// The flag is an unsigned OR: g++ 12 does not vectorise an OR into a bool, and left scalar this
// scan is a visible share of the chunked forward (benchmarks/kda.md).
template <class In>
bool row_may_be_below(In const* row, index_t K, float lb) noexcept {
  unsigned below = 0;
  if constexpr (std::is_same_v<In, float>)
    for (index_t d = 0; d < K; ++d) below |= unsigned(row[d] < lb);
  else
    for (index_t d = 0; d < K; ++d) below |= unsigned(load_as<double>(row[d]) < static_cast<double>(lb));
  return below != 0;
}
// The bound as the storage type holds it: a g equal to the bound rounded to In (for example
// the lower-bounded gate lb * sigmoid(z) = lb stored as bfloat16: -4.3 becomes -4.3125) meets
// the promise. Every lb in [-5, 0) rounds to a value >= -5 in float and bfloat16, so the dense
// diagonal tiles keep their licence.
template <class In>
double stored_bound(double lb) noexcept {
  return load_as<double>(store_as<In>(lb));
}
// The fast filters' threshold: a float below which a value of type In may fail the exact test.
template <class In>
float filter_bound(double lb) noexcept {
  return std::min(static_cast<float>(lb), static_cast<float>(stored_bound<In>(lb)));
}

template <class In>
bool gate_may_be_below(problem const& p, tensor_view<In const, 4> g, index_t t0, index_t t1) noexcept {
  if (!p.lower_bound) return false;
  float const lb = filter_bound<In>(*p.lower_bound);
  bool below = false;
  for (index_t b = 0; b < p.B; ++b)
    for (index_t t = t0; t < t1; ++t)
      for (index_t h = 0; h < p.HV; ++h) below |= row_may_be_below(&g(b, t, h, 0), p.K, lb);
  return below;
}

template <class In>
void check_gate_bound(problem const& p, tensor_view<In const, 4> g) {
  if (!p.lower_bound) return;
  float const lb = filter_bound<In>(*p.lower_bound);
  double const lb_stored = stored_bound<In>(*p.lower_bound);
  for (index_t b = 0; b < p.B; ++b)
    for (index_t t = 0; t < p.T; ++t)
      for (index_t h = 0; h < p.HV; ++h) {
        In const* row = &g(b, t, h, 0);
        if (!row_may_be_below(row, p.K, lb)) continue;  // the fast filter first
        for (index_t d = 0; d < p.K; ++d) {
          double x = load_as<double>(row[d]);
          // Compare in the storage precision's terms: a g equal to lb rounded to float or to
          // the storage type is fine.
          if (x < static_cast<double>(static_cast<float>(*p.lower_bound)) && x < *p.lower_bound && x < lb_stored)
            throw ::k3::error(error_kind::value,
                              "argument 'g': value " + fmt(x) + " at [" + std::to_string(b) + ", " + std::to_string(t) + ", " +
                                  std::to_string(h) + ", " + std::to_string(d) + "] is below the gate lower bound = " + fmt(*p.lower_bound),
                              "gate_lower_bound");
        }
      }
}

// The inputs forward and backward share (q, k, v, g, beta, h0), named as in the error messages,
// as a list of named views: shared_inputs(a)(f) calls f(name, view) for each.
template <class Args>
auto shared_inputs(Args const& a) {
  return ::k3::detail::named_views("q", a.q, "k", a.k, "v", a.v, "g", a.g, "beta", a.beta, "h0", a.h0);
}

// The shapes of q, k, v, g, beta and h0 (optional), or of their gradients: the same per-head
// layout, under the given names.
template <class Q, class Kv, class Vv, class G, class Bt, class H0>
void check_head_views(problem const& p, std::array<char const*, 6> const& name, Q const& q, Kv const& k, Vv const& v, G const& g,
                      Bt const& beta, H0 const& h0) {
  index_t const B = p.B, T = p.T, H = p.H, HV = p.HV, K = p.K, V = p.V, N = p.N;
  check_input(name[0], q, {B, T, H, K});
  check_input(name[1], k, {B, T, H, K});
  check_input(name[2], v, {B, T, HV, V});
  check_input(name[3], g, {B, T, HV, K});
  check_input(name[4], beta, {B, T, HV});
  check_optional(name[5], h0, {N, HV, K, V});
}

template <class Args>
void check_shared_inputs(Args const& a, problem const& p) {
  check_head_views(p, {"q", "k", "v", "g", "beta", "h0"}, a.q, a.k, a.v, a.g, a.beta, a.h0);
}

// The saved states: [HV, total chunks, per-chunk record], from the chunked form only.
template <class V>
void check_saved(V const& saved, problem const& p, options const& opt) {
  if (!present(saved)) return;
  ::k3::detail::require(opt.mode != algorithm::recurrent, error_kind::value,
                        "argument 'saved': saved states belong to the chunked form, got options::mode = recurrent");
  check_input("saved", saved, {p.HV, p.total_chunks(), saved_layout{p.K, p.V}.per()});
}

// check_gate: false leaves the gate bound to the caller (the threaded forward scans g in
// parallel first, see kda.hpp).
// Device views (cuda_device_space) are checked for everything but their values: the CUDA
// kernels are exact for any gate, so there the bound is a promise k3 does not read g to check.
template <class In, class S, class Space>
problem validate(forward_args<In, S, Space> const& a, options const& opt, bool check_gate = true) {
  problem p = make_problem<In>(a.q, a.v, opt);
  index_t const B = p.B, T = p.T, HV = p.HV, K = p.K, V = p.V, N = p.N;
  check_shared_inputs(a, p);
  check_input("o", a.o, {B, T, HV, V});
  check_optional("ht", a.ht, {N, HV, K, V});
  check_saved(a.saved, p, opt);
  check_outputs_apart(::k3::detail::named_views("o", a.o, "ht", a.ht, "saved", a.saved), shared_inputs(a));
  if constexpr (Space::host_accessible)
    if (check_gate) check_gate_bound<In>(p, a.g);
  return p;
}

template <class In, class S, class Space>
problem validate(backward_args<In, S, Space> const& a, options const& opt) {
  problem p = make_problem<In>(a.q, a.v, opt);
  check_shared_inputs(a, p);
  check_input("do", a.d_o, {p.B, p.T, p.HV, p.V});
  check_optional("dht", a.dht, {p.N, p.HV, p.K, p.V});
  check_head_views(p, {"dq", "dk", "dv", "dg", "dbeta", "dh0"}, a.dq, a.dk, a.dv, a.dg, a.dbeta, a.dh0);
  check_saved(a.saved, p, opt);
  check_outputs_apart(::k3::detail::named_views("dq", a.dq, "dk", a.dk, "dv", a.dv, "dg", a.dg, "dbeta", a.dbeta, "dh0", a.dh0),
                      ::k3::detail::joined(shared_inputs(a), ::k3::detail::named_views("do", a.d_o, "dht", a.dht, "saved", a.saved)));
  if constexpr (Space::host_accessible) check_gate_bound<In>(p, a.g);
  return p;
}

// Every slot(n) of the N sequences inside a pool of P states and used once; negative slots
// (padding) are skipped.
template <class SlotOf>
void check_slots(SlotOf&& slot, index_t N, index_t P) {
  std::vector<char> used(std::size_t(P), 0);
  for (index_t n = 0; n < N; ++n) {
    index_t const s = slot(n);
    if (s < 0) continue;  // padding: skipped by decode
    ::k3::detail::require(s < P, error_kind::value, [&] {
      return "argument 'slots': slot " + std::to_string(s) + " at index " + std::to_string(n) + " is out of range for a pool of " +
             std::to_string(P) + " states";
    });
    ::k3::detail::require(!used[std::size_t(s)], error_kind::value, [&] {
      return "argument 'slots': slot " + std::to_string(s) + " appears twice (index " + std::to_string(n) + ")";
    });
    used[std::size_t(s)] = 1;
  }
}

// Device slots are checked by the caller (the CUDA backend copies them to the host first).
template <class In, class S, class Space>
problem validate(decode_args<In, S, Space> const& a, options const& opt) {
  ::k3::detail::require(!opt.cu_seqlens.present(), error_kind::value, "option 'cu_seqlens': not used by the decode step (one token per sequence)");
  check_view("q", a.q);
  check_view("v", a.v);
  problem p;
  p.B = a.q.extent(0);
  p.N = p.B;
  p.T = 1;
  p.H = a.q.extent(1);
  p.K = a.q.extent(2);
  p.HV = a.v.extent(1);
  p.V = a.v.extent(2);
  ::k3::detail::require(p.H >= 1, error_kind::shape, [&] { return "argument 'q': expected at least one head, got shape " + ::k3::detail::shape_of(a.q); });
  ::k3::detail::require(p.HV >= 1 && p.HV % p.H == 0, error_kind::shape, [&] {
    return "argument 'v': the number of value heads HV (" + std::to_string(p.HV) + ") must be a positive multiple of the q/k heads H (" +
           std::to_string(p.H) + ")";
  });
  p.G = p.HV / p.H;
  p.scale = opt.scale ? *opt.scale : (p.K > 0 ? 1.0 / std::sqrt(double(p.K)) : 1.0);
  ::k3::detail::require(std::isfinite(p.scale), error_kind::value, [&] { return "option 'scale': must be finite, got " + fmt(p.scale); });
  // The step is exact for any gate, so g is not checked against the bound; an out-of-range
  // bound is still a bad option (as for forward and backward), not silently ignored.
  checked_lower_bound(opt);
  index_t const N = p.N, H = p.H, HV = p.HV, K = p.K, V = p.V;
  check_input("q", a.q, {N, H, K});
  check_input("k", a.k, {N, H, K});
  check_input("v", a.v, {N, HV, V});
  check_input("g", a.g, {N, HV, K});
  check_input("beta", a.beta, {N, HV});
  check_input("o", a.o, {N, HV, V});
  check_view("state_pool", a.state_pool);
  check_shape("state_pool", a.state_pool, {::k3::detail::any_extent, HV, K, V});
  check_inner_contiguous("state_pool", a.state_pool);
  bool const has32 = present(a.slots32), has64 = present(a.slots64);
  ::k3::detail::require(has32 != has64 || (N == 0 && !has32), error_kind::value,
                        "argument 'slots': give exactly one of slots32 (int32) or slots64 (int64)");
  if (has32) check_shape("slots", a.slots32, {N});
  if (has64) check_shape("slots", a.slots64, {N});
  if constexpr (Space::host_accessible)
    check_slots([&](index_t n) { return has32 ? index_t(a.slots32(n)) : index_t(a.slots64(n)); }, N, a.state_pool.extent(0));
  // The pool is read and written in place: checked as an output (not broadcast, apart from
  // o and from every input).
  check_outputs_apart(::k3::detail::named_views("o", a.o, "state_pool", a.state_pool),
                      ::k3::detail::named_views("q", a.q, "k", a.k, "v", a.v, "g", a.g, "beta", a.beta, "slots", a.slots32,
                                                "slots", a.slots64));
  return p;
}

}  // namespace detail

namespace detail {
// What algorithm::automatic stands for on the host backends (see algorithm).
inline algorithm host_form(options const& opt, bool saved, bool backward_pass) noexcept {
  if (opt.mode != algorithm::automatic) return opt.mode;
  return saved || backward_pass ? algorithm::chunk : algorithm::recurrent;
}
}  // namespace detail

// The form a call of forward (or backward) with these arguments and options runs: options::mode,
// or what algorithm::automatic resolves to. Any args type with `saved`; `Backend` is a host
// backend (every host backend resolves the same way).
template <class Backend, class Args>
algorithm chosen_form(Backend const&, Args const& a, options const& opt = {}) noexcept {
  constexpr bool backward_pass = requires { a.d_o; };
  return detail::host_form(opt, present(a.saved), backward_pass);
}

// Shape of forward_args::saved / backward_args::saved for these arguments and options:
// {HV, number of 64-token chunks over all sequences, floats per chunk record}. Any args type
// with q and v (forward_args or backward_args).
template <class Args>
std::array<index_t, 3> saved_shape(Args const& a, options const& opt = {}) {
  using In = typename decltype(a.q)::value_type;
  detail::problem const p = detail::make_problem<In>(a.q, a.v, opt);
  return {p.HV, p.total_chunks(), detail::saved_layout{p.K, p.V}.per()};
}

// Shape of forward_args::ht (and h0, dht, backward_args::dh0) for these arguments and options:
// {N sequences (B, or the count cu_seqlens gives), HV, K, V}. Checks q, v and cu_seqlens first,
// so a caller can size its outputs before it has them. Any args type with q and v.
template <class Args>
std::array<index_t, 4> state_shape(Args const& a, options const& opt = {}) {
  using In = typename decltype(a.q)::value_type;
  ::k3::detail::check_shape("v", a.v, {a.q.extent(0), a.q.extent(1), ::k3::detail::any_extent, ::k3::detail::any_extent});
  detail::problem const p = detail::make_problem<In>(a.q, a.v, opt);
  return {p.N, p.HV, p.K, p.V};
}

}  // namespace k3::kda
