// k3/moe.hpp — MoE routing with Quantile Balancing (Kimi K3), SiTU-GLU and the expert FFN
// backward without stored expert outputs, and expert placement (EPLB, MoonEP).
//
//   k3::moe::route(be, route_args<float>{...}, router_options)          route (+ fused histogram)
//   k3::moe::quantile_balancer                                        per-step causal QB state
//   k3::moe::qb_accumulate / qb_update / qb_exact_update / qb_offline_solve, qb_histogram
//                                                                     (quantile_balancing.hpp)
//   k3::moe::situ_glu / expert_ffn_forward / expert_ffn_backward     (situ.hpp)
//   k3::moe::grouped_ffn_forward / grouped_ffn_backward            the routed experts over grouped tokens
//                                                                  (grouped_ffn.hpp; CUDA: grouped_ffn.cuh)
//   k3::moe::latent_moe_forward / latent_moe_backward              the Stable LatentMoE layer (latent_moe.hpp)
//   k3::moe::moonep_latent_moe_forward / _backward                 the layer under MoonEP over MPI (expert_parallel.hpp)
//   k3::moe::eplb / moonep_rebalance / check_*                     (placement.hpp)
//   k3::moe::cuda::route_launch                                    (cuda.hpp / cuda.cuh, nvcc)
//
// Training loop, one MoE layer (bias is the only persistent state; freeze it for inference):
//
//   k3::cpu::threads<> cpu;
//   k3::moe::router_options opt;  opt.k = 16;                  // n = 896 experts
//   k3::moe::quantile_balancer qb(896, opt);                   // histogram mode, 1000 bins
//   for each micro-batch:  qb.route(cpu, k3::moe::route_args<float>{.scores = s, .indices = idx, .weights = w});  // old bias, counts added
//   at the optimizer step: qb.step(cpu, k3::moe::qb_step_args<Comm>{.comm = &comm});  // all-reduce counts, new bias
//   inference:             k3::moe::route(cpu, k3::moe::route_args<float>{.scores = s, .bias = qb.bias(), .indices = idx, .weights = w}, opt);
#pragma once
#include <concepts>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "k3/backend/cpu/serial.hpp"
#include "k3/backend/cpu/simd.hpp"
#include "k3/comm/communicator.hpp"
#include "k3/core/concepts.hpp"
#include "k3/moe/expert_parallel.hpp"
#include "k3/moe/latent_moe.hpp"
#include "k3/moe/placement.hpp"
#include "k3/moe/quantile_balancing.hpp"
#include "k3/moe/router.hpp"
#include "k3/moe/situ.hpp"
#include "k3/moe/threads.hpp"

namespace k3::moe {

namespace detail {
template <class B>
struct is_threads_backend : std::false_type {};
template <class A>
struct is_threads_backend<cpu::threads<A>> : std::true_type {};

// out with a cutoff to write: its own, or one in `store` (m entries), which the Quantile
// Balancing statistics read after routing.
inline route_outputs with_cutoff(route_outputs out, index_t m, std::vector<float>& store) {
  if (out.cutoff.empty()) {
    store.resize(static_cast<std::size_t>(m));
    out.cutoff = host_view(store.data(), m);
  }
  return out;
}
}  // namespace detail

// Routes m tokens with `bias` (see router.hpp for the exact definition and tie-breaking), and
// adds the margins to args.histogram when present (see route_args). cpu::threads<Arch> runs the
// fused SIMD pass; other host backends the reference.
template <HostBackend B, class T, class Space, class = ::k3::detail::reachable<B, Space>>
  requires std::same_as<T, float>
void route(B const& backend, route_args<T, Space> const& a, router_options const& opt = {}) {
  detail::route_outputs const out{a.indices, a.weights, a.cutoff, a.load};
  detail::validate_route(a.scores, a.bias, out, opt, a.mask);
  qb_histogram* const hist = a.histogram;
  if (hist) detail::check_route_histogram(*hist, opt, a.scores.extent(1));
  if constexpr (detail::is_threads_backend<B>::value) {
    detail::route_threads_impl(backend, a.scores, a.bias, out, opt, a.mask, hist);
  } else {
    if (!hist) {
      detail::route_serial(a.scores, a.bias, out, opt, a.mask);
      return;
    }
    std::vector<float> cut;
    detail::route_outputs const o = detail::with_cutoff(out, a.scores.extent(0), cut);
    detail::route_serial(a.scores, a.bias, o, opt, a.mask);
    qb_accumulate(backend, qb_accumulate_args<float>{.scores = a.scores, .cutoff = o.cutoff, .mask = a.mask, .histogram = hist}, opt);
  }
}

enum class qb_mode { exact, histogram };

// The balancer's configuration (the update itself is qb_update / qb_exact_update).
struct qb_options {
  qb_mode mode = qb_mode::histogram;
  index_t bins = 1000;  // K3 / Megatron default
  double ema = 0.0;     // 0 = replace each step (Megatron default); K3 reports EMA helps
};

// Per-step causal Quantile Balancing for one MoE layer. route() uses the current bias and, in
// training, accumulates this micro-batch's statistics; step() (once per optimizer step, after
// every micro-batch) turns the pooled statistics into the bias for the NEXT batches. The batch
// that produced an update is never routed with it. Only bias() is persistent state; the
// statistics are dropped by step() and discard() (a failed or retried step).
struct qb_route_options {
  bool training = true;  // false: route only (inference, or a batch that must not update the bias)
};

// The communicator of the data-parallel ranks whose statistics pool (not owned); none: this
// process only.
template <Communicator C = single_process>
struct qb_step_args {
  C const* comm = nullptr;
};

class quantile_balancer {
 public:
  quantile_balancer(std::vector<float> bias, router_options ropt, qb_options qopt = {})
      : bias_(std::move(bias)), ropt_(ropt), qopt_(qopt) {
    detail::require(!bias_.empty(), error_kind::value, "quantile_balancer: argument 'bias' is empty");
    detail::require(ropt_.n_groups == 1, error_kind::value, [&] { return detail::qb_groups_message(ropt_.n_groups); });
    detail::check_ema(qopt_.ema);
    reset_stats();
  }
  quantile_balancer(index_t experts, router_options ropt, qb_options qopt = {})
      : quantile_balancer(std::vector<float>(static_cast<std::size_t>(experts > 0 ? experts : 0), 0.f), ropt, qopt) {}

  const_view<float, 1> bias() const noexcept { return {bias_.data(), {static_cast<index_t>(bias_.size())}}; }
  router_options const& options() const noexcept { return ropt_; }
  qb_histogram const& histogram() const noexcept { return hist_; }
  std::int64_t pending_tokens() const noexcept { return qopt_.mode == qb_mode::histogram ? hist_.tokens() : exact_rows_; }

  // Routes args (bias and histogram absent: the balancer supplies its own) with the current
  // bias and, when opt.training, adds this micro-batch to the statistics of the next step().
  template <HostBackend B, class T>
    requires std::same_as<T, float>
  void route(B const& backend, route_args<T> const& args, qb_route_options const& opt = {}) {
    detail::require(!present(args.bias), error_kind::value,
                    "quantile_balancer::route: argument 'bias': must be absent (the balancer routes with its own bias)");
    detail::require(args.histogram == nullptr, error_kind::value,
                    "quantile_balancer::route: argument 'histogram': must be absent (the balancer keeps its own statistics)");
    route_args<T> a = args;
    a.bias = bias();
    if (!opt.training) {
      moe::route(backend, a, ropt_);
      return;
    }
    if (qopt_.mode == qb_mode::histogram) {
      a.histogram = &hist_;
      moe::route(backend, a, ropt_);
      return;
    }
    std::vector<float> cut;
    if (!present(a.cutoff)) {
      cut.resize(static_cast<std::size_t>(a.scores.extent(0)));
      a.cutoff = host_view(cut.data(), a.scores.extent(0));
    }
    moe::route(backend, a, ropt_);
    index_t const n = a.scores.extent(1);
    for (index_t i = 0; i < a.scores.extent(0); ++i) {
      if (present(a.mask) && a.mask(i) == 0) continue;
      for (index_t j = 0; j < n; ++j) exact_s_.push_back(detail::load_score(a.scores(i, j), ropt_.input));
      exact_a_.push_back(a.cutoff(i));
      ++exact_rows_;
    }
  }

  // Applies the update from everything routed since the last step. Histogram mode all-reduces
  // the counts over args.comm first when one is given (every rank must call step). Returns
  // whether the bias changed.
  template <HostBackend B, Communicator C = single_process>
  bool step(B const& backend, qb_step_args<C> const& args = {}) {
    bool changed = false;
    auto b = tensor_view<float, 1>(bias_.data(), {static_cast<index_t>(bias_.size())});
    qb_update_options const uo{.router = ropt_, .ema = qopt_.ema};
    if (qopt_.mode == qb_mode::histogram) {
      changed = qb_update(backend, qb_update_args<float, C>{.histogram = &hist_, .bias = b, .comm = args.comm}, uo);
    } else {
      detail::require(args.comm == nullptr || args.comm->size() == 1, error_kind::unsupported,
                      "quantile_balancer: exact mode is single-process; use qb_mode::histogram across ranks");
      if (exact_rows_ > 0) {
        qb_update_options o = uo;
        o.router.input = score_kind::scores;
        index_t const n = static_cast<index_t>(bias_.size());
        changed = qb_exact_update(backend,
                                  qb_exact_update_args<float>{.scores = const_view<float, 2>(exact_s_.data(), {exact_rows_, n}),
                                                              .cutoff = const_view<float, 1>(exact_a_.data(), {exact_rows_}),
                                                              .bias = b},
                                  o);
      }
    }
    reset_stats();
    return changed;
  }

  void discard() { reset_stats(); }

 private:
  void reset_stats() {
    if (qopt_.mode == qb_mode::histogram) {
      if (hist_.bins() == qopt_.bins) hist_.reset_for_bias(bias());
      else hist_ = qb_histogram::for_bias(bias(), qopt_.bins);
    }
    exact_s_.clear();
    exact_a_.clear();
    exact_rows_ = 0;
  }
  std::vector<float> bias_;
  router_options ropt_;
  qb_options qopt_;
  qb_histogram hist_;
  std::vector<float> exact_s_, exact_a_;
  index_t exact_rows_ = 0;
};

}  // namespace k3::moe
