// k3/kda/cuda/validate.hpp — host-side argument checks of the KDA CUDA launchers. Plain
// C++ (no CUDA header), so the checks compile and can be exercised anywhere.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "k3/core/error.hpp"
#include "k3/core/memory_space.hpp"
#include "k3/core/validate.hpp"
#include "k3/kda/cuda_api.hpp"

namespace k3::kda::cuda::detail {

struct layout {
  index_t N = 0;        // number of sequences
  index_t max_len = 0;  // longest sequence
  float scale = 0.0f;   // effective scale
};

inline void require_ptr(void const* p, char const* name, bool needed) {
  ::k3::detail::require(!needed || p != nullptr, error_kind::value, [&] { return std::string("argument '") + name + "': null device pointer"; });
}

inline void check_dims(index_t B, index_t T, index_t H, index_t HV, index_t K, index_t V) {
  ::k3::detail::require(B >= 0 && T >= 0, error_kind::value, [&] {
    return "arguments 'B', 'T': must be >= 0, got B = " + std::to_string(B) + ", T = " + std::to_string(T);
  });
  ::k3::detail::require(H >= 1 && HV >= 1 && HV % H == 0, error_kind::shape, [&] {
    return "argument 'HV': must be a positive multiple of H, got H = " + std::to_string(H) + ", HV = " + std::to_string(HV);
  });
  ::k3::detail::require(K >= 1 && K <= max_head_dim_k, error_kind::unsupported, [&] {
    return "argument 'K': the CUDA kernels support 1 <= K <= " + std::to_string(max_head_dim_k) + ", got " + std::to_string(K);
  });
  ::k3::detail::require(V >= 1, error_kind::value, [&] { return "argument 'V': must be >= 1, got " + std::to_string(V); });
}

inline float effective_scale(float scale, index_t K) {
  return (scale > 0.0f && std::isfinite(scale)) ? scale : 1.0f / std::sqrt(static_cast<float>(K));
}

// Sequences: B rows of T tokens, or (B == 1) the cu_seqlens segments.
inline layout check_sequences(index_t B, index_t T, index_t N, std::int64_t const* cu, std::int64_t const* cu_host) {
  layout l;
  if (cu == nullptr) {
    ::k3::detail::require(cu_host == nullptr, error_kind::shape, "argument 'cu_seqlens': cu_seqlens_host given without the device cu_seqlens");
    l.N = B;
    l.max_len = T;
    return l;
  }
  ::k3::detail::require(cu_host != nullptr, error_kind::shape, "argument 'cu_seqlens_host': needed (same values on the host) when cu_seqlens is given");
  ::k3::detail::require(B == 1, error_kind::shape, [&] { return "argument 'cu_seqlens': needs batch size 1, got B = " + std::to_string(B); });
  ::k3::detail::require(N >= 0, error_kind::value, [&] { return "argument 'N': must be >= 0, got " + std::to_string(N); });
  ::k3::detail::require(cu_host[0] == 0, error_kind::value, [&] { return "argument 'cu_seqlens': must start at 0, got " + std::to_string(cu_host[0]); });
  for (index_t i = 1; i <= N; ++i) {
    ::k3::detail::require(cu_host[i] >= cu_host[i - 1], error_kind::value, [&] {
      return "argument 'cu_seqlens': must be non-decreasing, got " + std::to_string(cu_host[i - 1]) + " then " +
             std::to_string(cu_host[i]) + " at index " + std::to_string(i);
    });
    l.max_len = std::max<index_t>(l.max_len, cu_host[i] - cu_host[i - 1]);
  }
  ::k3::detail::require(cu_host[N] == T, error_kind::value, [&] {
    return "argument 'cu_seqlens': must end at T = " + std::to_string(T) + ", got " + std::to_string(cu_host[N]);
  });
  l.N = N;
  return l;
}

// The checks forward and backward share: dimensions, sequences, the five inputs, the scale.
template <class Args>
layout check_inputs(Args const& a) {
  check_dims(a.B, a.T, a.H, a.HV, a.K, a.V);
  layout l = check_sequences(a.B, a.T, a.N, a.cu_seqlens, a.cu_seqlens_host);
  bool const tokens = a.B * a.T > 0;
  require_ptr(a.q, "q", tokens);
  require_ptr(a.k, "k", tokens);
  require_ptr(a.v, "v", tokens);
  require_ptr(a.g, "g", tokens);
  require_ptr(a.beta, "beta", tokens);
  l.scale = effective_scale(a.scale, a.K);
  return l;
}

// Each argument as the contiguous device range it spans (empty when null), for
// ::k3::detail::check_outputs_apart: no output over an input or another output (other blocks
// still read the inputs while one writes).
template <class T>
auto span(T* p, index_t n) {
  return ::k3::detail::flat_view<cuda_device_space>(p, n);
}

template <class Args, class F>
void for_each_input(Args const& a, layout const& l, F&& f) {
  index_t const BT = a.B * a.T;
  f("q", span(a.q, BT * a.H * a.K));
  f("k", span(a.k, BT * a.H * a.K));
  f("v", span(a.v, BT * a.HV * a.V));
  f("g", span(a.g, BT * a.HV * a.K));
  f("beta", span(a.beta, BT * a.HV));
  f("h0", span(a.h0, l.N * a.HV * a.K * a.V));
  f("cu_seqlens", span(a.cu_seqlens, a.cu_seqlens ? l.N + 1 : 0));
}

template <class S>
layout check(fwd_args<S> const& a) {
  layout const l = check_inputs(a);
  require_ptr(a.o, "o", a.B * a.T > 0);
  ::k3::detail::check_outputs_apart(
      [&](auto&& f) {
        f("o", span(a.o, a.B * a.T * a.HV * a.V));
        f("ht", span(a.ht, l.N * a.HV * a.K * a.V));
      },
      [&](auto&& f) { for_each_input(a, l, f); });
  return l;
}

template <class S>
layout check(bwd_args<S> const& a) {
  layout const l = check_inputs(a);
  bool const tokens = a.B * a.T > 0;
  require_ptr(a.do_, "do", tokens);
  require_ptr(a.dq, "dq", tokens);
  require_ptr(a.dk, "dk", tokens);
  require_ptr(a.dv, "dv", tokens);
  require_ptr(a.dg, "dg", tokens);
  require_ptr(a.dbeta, "dbeta", tokens);
  index_t const BT = a.B * a.T, NS = l.N * a.HV * a.K * a.V;
  ::k3::detail::check_outputs_apart(
      [&](auto&& f) {
        f("dq", span(a.dq, BT * a.H * a.K));
        f("dk", span(a.dk, BT * a.H * a.K));
        f("dv", span(a.dv, BT * a.HV * a.V));
        f("dg", span(a.dg, BT * a.HV * a.K));
        f("dbeta", span(a.dbeta, BT * a.HV));
        f("dh0", span(a.dh0, NS));
      },
      [&](auto&& f) {
        for_each_input(a, l, f);
        f("do", span(a.do_, BT * a.HV * a.V));
        f("dht", span(a.dht, NS));
      });
  return l;
}

template <class S>
float check(decode_args<S> const& a) {
  check_dims(a.N, 1, a.H, a.HV, a.K, a.V);
  bool const any = a.N > 0;
  require_ptr(a.q, "q", any);
  require_ptr(a.k, "k", any);
  require_ptr(a.v, "v", any);
  require_ptr(a.g, "g", any);
  require_ptr(a.beta, "beta", any);
  require_ptr(a.o, "o", any);
  require_ptr(a.state, "state", any && a.P > 0);
  ::k3::detail::require(a.P >= 0, error_kind::value, [&] { return "argument 'P': must be >= 0, got " + std::to_string(a.P); });
  if (a.slots == nullptr) {
    ::k3::detail::require(a.slots_host == nullptr, error_kind::value, "argument 'slots': slots_host given without the device slots");
    ::k3::detail::require(a.P >= a.N, error_kind::value, [&] {
      return "argument 'state': without slots the pool needs at least N = " + std::to_string(a.N) + " states, got P = " +
             std::to_string(a.P);
    });
  } else if (a.slots_host != nullptr) {
    // distinctness: a small sort-free check over the pool
    std::string seen(static_cast<std::size_t>(a.P), '\0');
    for (index_t n = 0; n < a.N; ++n) {
      std::int64_t const s = a.slots_host[n];
      if (s < 0) continue;  // padding
      ::k3::detail::require(s < a.P, error_kind::value, [&] {
        return "argument 'slots': slot " + std::to_string(s) + " at index " + std::to_string(n) + " is outside the pool [0, " +
               std::to_string(a.P) + ")";
      });
      ::k3::detail::require(!seen[static_cast<std::size_t>(s)], error_kind::value, [&] {
        return "argument 'slots': slot " + std::to_string(s) + " appears twice (index " + std::to_string(n) + ")";
      });
      seen[static_cast<std::size_t>(s)] = 1;
    }
  }
  ::k3::detail::check_outputs_apart(::k3::detail::named_views("o", span(a.o, a.N * a.HV * a.V),
                                                              "state", span(a.state, a.P * a.HV * a.K * a.V)),
                                    ::k3::detail::named_views("q", span(a.q, a.N * a.H * a.K), "k", span(a.k, a.N * a.H * a.K),
                                                              "v", span(a.v, a.N * a.HV * a.V), "g", span(a.g, a.N * a.HV * a.K),
                                                              "beta", span(a.beta, a.N * a.HV), "slots", span(a.slots, a.N)));
  return effective_scale(a.scale, a.K);
}

inline void check_rows(index_t rows, index_t D) {
  ::k3::detail::require(rows >= 0 && D >= 0, error_kind::shape, [&] {
    return "arguments 'rows', 'D': must be >= 0, got rows = " + std::to_string(rows) + ", D = " + std::to_string(D);
  });
}

inline void check(gate_params const& p) {
  ::k3::detail::require(p.rows >= 0 && p.HV >= 1 && p.K >= 1, error_kind::shape, [&] {
    return "arguments 'rows', 'HV', 'K': need rows >= 0, HV >= 1, K >= 1, got " + std::to_string(p.rows) + ", " +
           std::to_string(p.HV) + ", " + std::to_string(p.K);
  });
  if (p.kind == gate_kind::lower_bound)
    ::k3::detail::require(p.lower_bound >= -5.0f && p.lower_bound < 0.0f, error_kind::value, [&] {
      return "argument 'lower_bound': must lie in [-5, 0), got " + ::k3::detail::format_number(p.lower_bound);
    });
}

// Returns the number of sequences.
inline index_t check(conv_params const& p) {
  ::k3::detail::require(p.C >= 1 && p.W >= 1, error_kind::value, [&] {
    return "arguments 'C', 'W': need C >= 1 and W >= 1, got C = " + std::to_string(p.C) + ", W = " + std::to_string(p.W);
  });
  require_ptr(p.weight, "weight", true);
  ::k3::detail::require(p.B >= 0 && p.T >= 0, error_kind::value, [&] {
    return "arguments 'B', 'T': must be >= 0, got B = " + std::to_string(p.B) + ", T = " + std::to_string(p.T);
  });
  return check_sequences(p.B, p.T, p.N, p.cu_seqlens, p.cu_seqlens_host).N;
}

}  // namespace k3::kda::cuda::detail
