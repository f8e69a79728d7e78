// k3/moe/quantile_balancing.hpp — Quantile Balancing (QB) of the router bias (Kimi K3).
//
// Balanced assignment as an LP with token multipliers alpha_i and expert multipliers beta_j;
// exact coordinate minimisation gives alpha_i = (k+1)-th largest of s_i - beta and
// beta_j = (q+1)-th largest of s_:j - alpha (q = floor(m k / n)). Routing by argtop_k(s - beta)
// means the additive bias is b = -beta, i.e.
//
//   b_j = (q+1)-th smallest of r_ij,   r_ij = alpha_i - s_ij        (then mean-centred)
//
// (an overloaded expert has many large margins s - alpha, a large beta_j, a negative b_j).
//
// Three ways to get it, all here:
//   qb_offline_solve      Algorithm 1: alternate alpha/beta T times on one batch (tooling).
//   qb_exact_update       one causal step from a routed batch: alpha is the cut-off the router
//                         returned with the OLD bias; the result is used from the next batch.
//   qb_histogram          per-expert integer counts of r over [min(b)-1, max(b)+1] in B bins;
//                         counts add, so micro-batches and ranks merge exactly (all-reduce),
//                         and qb_update interpolates the pooled quantile inside the
//                         bin that holds it (error <= one bin width).
// Only the bias persists (and is frozen at inference); the histogram is training-only state.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "k3/comm/communicator.hpp"
#include "k3/core/concepts.hpp"
#include "k3/core/config.hpp"
#include "k3/core/error.hpp"
#include "k3/core/tensor_view.hpp"
#include "k3/core/validate.hpp"
#include "k3/moe/router.hpp"

namespace k3::moe {

// Bin of margin r in a histogram over [lo, lo + bins / inv_w). Out-of-range margins are
// clamped into the end bins. Every backend (SIMD, CUDA) must evaluate exactly this float
// sequence so that counts agree bit-for-bit: t = floor((r - lo) * inv_w), clamp, convert.
K3_INLINE std::int32_t qb_bin(float r, float lo, float inv_w, std::int32_t bins) noexcept {
  float t = std::floor((r - lo) * inv_w);
  t = t < 0.f ? 0.f : t;
  t = t > float(bins - 1) ? float(bins - 1) : t;
  return static_cast<std::int32_t>(t);
}

// Per-expert histogram of the margins r_ij = alpha_i - s_ij of the routed (non-padding)
// tokens. Row j holds expert j's counts; every token adds one count to every row.
class qb_histogram {
 public:
  qb_histogram() = default;
  qb_histogram(index_t experts, index_t bins, float lo, float hi) : n_(experts), bins_(bins), lo_(lo), hi_(hi) {
    detail::require(experts >= 1, error_kind::value, [&] { return "qb_histogram: argument 'experts' must be >= 1, got " + std::to_string(experts); });
    detail::require(bins >= 1 && bins <= (index_t(1) << 24), error_kind::value, [&] {
      return "qb_histogram: argument 'bins' must be in [1, 2^24], got " + std::to_string(bins);
    });
    detail::require(std::isfinite(lo) && std::isfinite(hi) && hi > lo, error_kind::value, [&] {
      return "qb_histogram: need finite bounds lo < hi, got [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
    });
    inv_w_ = float(bins) / (hi - lo);
    // hi - lo can overflow to inf (inverse 0: every margin in bin 0) or be so small that the
    // inverse is inf (0 * inf = NaN bin indices): neither gives a usable histogram.
    detail::require(std::isfinite(inv_w_) && inv_w_ > 0.f, error_kind::value, [&] {
      return "qb_histogram: " + std::to_string(bins) + " bins over [" + std::to_string(lo) + ", " + std::to_string(hi) +
             "] give a bin width whose inverse is not a finite positive float";
    });
    counts_.assign(static_cast<std::size_t>(experts * bins), 0);
    zero_ = true;
  }

  // The histogram for routing with `bias`: bounds [min(b) - 1, max(b) + 1], which contain
  // every margin when scores lie in (0, 1). Build it from the bias USED for routing.
  static qb_histogram for_bias(const_view<float, 1> bias, index_t bins = 1000) {
    ::k3::detail::check_view("bias", bias);
    detail::require(bias.extent(0) >= 1, error_kind::value, "qb_histogram::for_bias: argument 'bias' is empty");
    float lo = bias(0), hi = bias(0);
    for (index_t j = 0; j < bias.extent(0); ++j) {
      detail::require(std::isfinite(bias(j)), error_kind::value, [&] { return "argument 'bias': non-finite value at expert " + std::to_string(j); });
      lo = std::min(lo, bias(j));
      hi = std::max(hi, bias(j));
    }
    return qb_histogram(bias.extent(0), bins, lo - 1.f, hi + 1.f);
  }

  // Re-targets this histogram to a new bias (counts zeroed, bounds [min(b) - 1, max(b) + 1])
  // keeping its storage and the CPU scatter's scratch, so a training loop allocates once.
  void reset_for_bias(const_view<float, 1> bias) {
    auto fresh = for_bias(bias, bins_);
    n_ = fresh.n_;
    lo_ = fresh.lo_;
    hi_ = fresh.hi_;
    inv_w_ = fresh.inv_w_;
    counts_.assign(static_cast<std::size_t>(n_ * bins_), 0);
    zero_ = true;
  }

  // Per-thread scratch of the fused CPU scatter (k3/moe/threads.hpp), kept across calls so
  // the large private histograms are not re-faulted every batch. Not part of the value.
  std::vector<std::uint8_t>& scratch(std::size_t thread) const {
    if (scratch_.size() <= thread) scratch_.resize(thread + 1);
    return scratch_[thread];
  }

  index_t experts() const noexcept { return n_; }
  index_t bins() const noexcept { return bins_; }
  float lo() const noexcept { return lo_; }
  float hi() const noexcept { return hi_; }
  float inv_width() const noexcept { return inv_w_; }
  double width() const noexcept { return (double(hi_) - double(lo_)) / double(bins_); }

  // Mutable access may change the counts: the histogram is no longer known to be zero.
  std::int64_t* data() noexcept {
    zero_ = false;
    return counts_.data();
  }
  std::int64_t const* data() const noexcept { return counts_.data(); }
  tensor_view<std::int64_t, 2> counts() noexcept { return {data(), {n_, bins_}}; }
  const_view<std::int64_t, 2> counts() const noexcept { return {counts_.data(), {n_, bins_}}; }
  std::int64_t& operator()(index_t j, index_t l) noexcept {
    zero_ = false;
    return counts_[static_cast<std::size_t>(j * bins_ + l)];
  }
  std::int64_t operator()(index_t j, index_t l) const noexcept { return counts_[static_cast<std::size_t>(j * bins_ + l)]; }

  // Tokens counted: every token adds one count to each row, so row 0's total.
  std::int64_t tokens() const noexcept {
    std::int64_t t = 0;
    for (index_t l = 0; l < bins_; ++l) t += counts_[static_cast<std::size_t>(l)];
    return t;
  }
  void clear() noexcept {
    std::fill(counts_.begin(), counts_.end(), 0);
    zero_ = true;
  }
  // True only while every count is known to be 0: after construction, clear() or
  // reset_for_bias(), before any mutable access. The CPU scatter then writes its sum without
  // reading the old counts (7 MB for K3 that need not be read). As with std::vector::clear,
  // clear() and reset_for_bias() end the use of pointers and views obtained before them for
  // writing: take data(), counts() or (j, l) again (a write through an older one would not be
  // seen by this flag, and the next CPU routing call would overwrite it).
  bool known_zero() const noexcept { return zero_; }
  bool same_geometry(qb_histogram const& o) const noexcept {
    return n_ == o.n_ && bins_ == o.bins_ && lo_ == o.lo_ && hi_ == o.hi_;
  }
  // Adds another partial histogram (another micro-batch or shard) built with the same bounds.
  void merge(qb_histogram const& o) {
    detail::require(same_geometry(o), error_kind::value, [&] {
      return "qb_histogram::merge: geometry differs (experts " + std::to_string(n_) + " vs " + std::to_string(o.n_) + ", bins " +
             std::to_string(bins_) + " vs " + std::to_string(o.bins_) + ", bounds must be identical)";
    });
    for (std::size_t i = 0; i < counts_.size(); ++i) counts_[i] += o.counts_[i];
    zero_ = zero_ && o.zero_;
  }
  // Sums the counts of every rank holding different tokens (data-parallel population).
  // Integer counts make the pooled histogram, and so the bias, independent of the sharding.
  template <Communicator C>
  void all_reduce(C const& comm) {
    comm.all_reduce_sum(tensor_view<std::int64_t, 1>(data(), {static_cast<index_t>(counts_.size())}));
  }
  friend bool operator==(qb_histogram const& a, qb_histogram const& b) noexcept {
    return a.same_geometry(b) && a.counts_ == b.counts_;
  }

 private:
  index_t n_ = 0, bins_ = 0;
  float lo_ = 0.f, hi_ = 1.f, inv_w_ = 0.f;
  std::vector<std::int64_t> counts_;
  bool zero_ = true;
  mutable std::vector<std::vector<std::uint8_t>> scratch_;
};

namespace detail {

// The histogram's checks of route() on every backend.
inline void check_route_histogram(qb_histogram const& hist, router_options const& opt, index_t n) {
  ::k3::detail::require(opt.n_groups == 1, error_kind::value, [&] { return qb_groups_message(opt.n_groups); });
  ::k3::detail::require(hist.experts() == n, error_kind::shape, [&] {
    return "argument 'histogram': built for " + std::to_string(hist.experts()) + " experts, scores have " + std::to_string(n);
  });
  ::k3::detail::require(hist.experts() * hist.bins() <= index_t(0x7fffffff), error_kind::value, [&] {
    return "argument 'histogram': experts x bins = " + std::to_string(hist.experts() * hist.bins()) + " exceeds 2^31 - 1";
  });
}

}  // namespace detail

namespace detail {

inline void check_qb_inputs(const_view<float, 2> scores, const_view<float, 1> cutoff, const_view<std::uint8_t, 1> mask,
                            router_options const& opt) {
  ::k3::detail::check_view("scores", scores);
  index_t const m = scores.extent(0), n = scores.extent(1);
  ::k3::detail::require(opt.k >= 1 && opt.k < n, error_kind::value, [&] {
    return "argument 'k': need 1 <= k < n, got k = " + std::to_string(opt.k) + ", n = " + std::to_string(n);
  });
  ::k3::detail::require(opt.n_groups == 1, error_kind::value, [&] { return detail::qb_groups_message(opt.n_groups); });
  ::k3::detail::check_view("cutoff", cutoff);
  ::k3::detail::check_shape("cutoff", cutoff, {m});
  if (!mask.empty()) {
    ::k3::detail::check_view("mask", mask);
    ::k3::detail::check_shape("mask", mask, {m});
  }
  // A NaN margin has no bin (casting it to an index is undefined) and breaks the ordering
  // nth_element relies on: reject non-finite values of the real (non-padding) tokens.
  for (index_t i = 0; i < m; ++i) {
    if (!mask.empty() && mask(i) == 0) continue;
    ::k3::detail::require(std::isfinite(cutoff(i)), error_kind::value, [&] { return "argument 'cutoff': non-finite value at token " + std::to_string(i); });
    for (index_t j = 0; j < n; ++j)
      ::k3::detail::require(std::isfinite(scores(i, j)), error_kind::value, [&] { return nonfinite_message(i, j, opt.input); });
  }
}

// Mean-centre, optional EMA against the previous bias, re-centre. In double, stored as FP32.
inline void finish_bias(std::vector<double>& b_new, tensor_view<float, 1> bias, double ema) {
  auto centre = [](std::vector<double>& v) {
    double mean = 0;
    for (double x : v) mean += x;
    mean /= double(v.size());
    for (double& x : v) x -= mean;
  };
  centre(b_new);
  if (ema > 0) {
    for (std::size_t j = 0; j < b_new.size(); ++j) b_new[j] = ema * double(bias(static_cast<index_t>(j))) + (1 - ema) * b_new[j];
    centre(b_new);
  }
  for (std::size_t j = 0; j < b_new.size(); ++j) bias(static_cast<index_t>(j)) = static_cast<float>(b_new[j]);
}

inline void check_ema(double ema) {
  ::k3::detail::require(ema >= 0 && ema < 1, error_kind::value, [&] { return "argument 'ema': need 0 <= ema < 1, got " + std::to_string(ema); });
}

}  // namespace detail

// Inputs of qb_accumulate: a routed batch and the histogram its margins are added to.
template <class T>
struct qb_accumulate_args {
  const_view<T, 2> scores;                // [m, n]
  const_view<float, 1> cutoff;            // [m]  what the router returned for these scores
  const_view<std::uint8_t, 1> mask = {};  // [m]
  qb_histogram* histogram = nullptr;      // required; counts added
};

// The histogram update from a (pooled) histogram. With a communicator the counts are first
// summed over its ranks in place (every rank must call it).
template <class T, Communicator C = single_process>
struct qb_update_args {
  qb_histogram* histogram = nullptr;  // required
  tensor_view<T, 1> bias;             // [n]  the bias routed with; overwritten by the next one
  C const* comm = nullptr;            // optional
};

// One causal exact update from a routed batch.
template <class T>
struct qb_exact_update_args {
  const_view<T, 2> scores;                // [m, n]
  const_view<float, 1> cutoff;            // [m]  the router's cut-off with `bias`
  const_view<std::uint8_t, 1> mask = {};  // [m]
  tensor_view<float, 1> bias;             // [n]  the bias routed with; overwritten by the next one
};

// The update options: router.k (and, for the exact update, router.input) as routed; ema in
// [0, 1) blends the new bias with the old one.
struct qb_update_options {
  router_options router{};
  double ema = 0.0;
};

// Adds the margins of a routed batch to args.histogram (reference scatter) with the router's
// options of that batch.
template <HostBackend B, class T>
  requires std::same_as<T, float>
void qb_accumulate(B const&, qb_accumulate_args<T> const& a, router_options const& opt = {}) {
  detail::check_qb_inputs(a.scores, a.cutoff, a.mask, opt);
  detail::require(a.histogram != nullptr, error_kind::value, "argument 'histogram': missing (null)");
  qb_histogram& hist = *a.histogram;
  auto const scores = a.scores;
  auto const cutoff = a.cutoff;
  auto const mask = a.mask;
  index_t const m = scores.extent(0), n = scores.extent(1);
  detail::require(hist.experts() == n, error_kind::value, [&] {
    return "argument 'histogram': built for " + std::to_string(hist.experts()) + " experts, scores have " + std::to_string(n);
  });
  auto const bins = static_cast<std::int32_t>(hist.bins());
  for (index_t i = 0; i < m; ++i) {
    if (!mask.empty() && mask(i) == 0) continue;
    float const a_i = cutoff(i);
    for (index_t j = 0; j < n; ++j) {
      float const s = detail::load_score(scores(i, j), opt.input);
      ++hist(j, qb_bin(a_i - s, hist.lo(), hist.inv_width(), bins));
    }
  }
}

namespace detail {

// The pooled quantile estimate, before centring: for each expert the position of the
// q-th of m counted margins (q = m k / n, real), interpolated linearly inside its bin.
// Returns false (and leaves `out` alone) when the histogram is empty.
inline bool qb_histogram_quantile(qb_histogram const& hist, index_t k, std::vector<double>& out) {
  index_t const n = hist.experts(), B = hist.bins();
  detail::require(k >= 1 && k < n, error_kind::value, [&] { return "argument 'k': need 1 <= k < n = " + std::to_string(n) + ", got " + std::to_string(k); });
  std::int64_t const m = hist.tokens();
  if (m == 0) return false;
  double const q = double(m) * double(k) / double(n);
  double const R = std::max(1.0, std::ceil(q));
  double const w = hist.width();
  out.assign(static_cast<std::size_t>(n), 0.0);
  for (index_t j = 0; j < n; ++j) {
    std::int64_t c = 0;
    index_t l = 0;
    for (; l < B; ++l) {
      if (double(c + hist(j, l)) >= R) break;
      c += hist(j, l);
    }
    if (l == B) l = B - 1, c -= hist(j, B - 1);  // unreachable for a consistent histogram
    double const h = double(hist(j, l));
    double const t = std::clamp((q - double(c)) / std::max(h, 1.0), 0.0, 1.0);
    out[static_cast<std::size_t>(j)] = double(hist.lo()) + (double(l) + t) * w;
  }
  return true;
}

}  // namespace detail

// Step-end update from a (pooled) histogram: new bias = centred estimate (optionally an EMA
// with the old bias, re-centred). An empty histogram keeps the bias. Returns whether the bias
// changed. The caller then builds the next histogram with qb_histogram::for_bias(bias).
template <HostBackend B, class T, Communicator C>
  requires std::same_as<T, float>
bool qb_update(B const&, qb_update_args<T, C> const& a, qb_update_options const& opt = {}) {
  detail::check_ema(opt.ema);
  detail::require(a.histogram != nullptr, error_kind::value, "argument 'histogram': missing (null)");
  qb_histogram& hist = *a.histogram;
  auto const bias = a.bias;
  ::k3::detail::check_view("bias", bias);
  detail::check_shape("bias", bias, {hist.experts()});
  ::k3::detail::check_not_broadcast("bias", bias);
  if (a.comm) hist.all_reduce(*a.comm);
  std::vector<double> b;
  if (!detail::qb_histogram_quantile(hist, opt.router.k, b)) return false;
  detail::finish_bias(b, bias, opt.ema);
  return true;
}

namespace detail {

// Exact column quantiles of a routed batch, before centring: b_j = (q+1)-th smallest of
// alpha_i - s_ij over real tokens, q = floor(m k / n). Returns false when no token is real.
inline bool qb_exact_quantile(const_view<float, 2> scores, const_view<float, 1> cutoff, router_options const& opt,
                              std::vector<double>& out, const_view<std::uint8_t, 1> mask = {}) {
  detail::check_qb_inputs(scores, cutoff, mask, opt);
  index_t const m = scores.extent(0), n = scores.extent(1);
  std::vector<index_t> rows;
  for (index_t i = 0; i < m; ++i)
    if (mask.empty() || mask(i) != 0) rows.push_back(i);
  index_t const mr = static_cast<index_t>(rows.size());
  if (mr == 0) return false;
  index_t const q = mr * opt.k / n;  // < mr because k < n
  std::vector<float> col(static_cast<std::size_t>(mr));
  out.assign(static_cast<std::size_t>(n), 0.0);
  for (index_t j = 0; j < n; ++j) {
    for (index_t t = 0; t < mr; ++t) {
      index_t i = rows[static_cast<std::size_t>(t)];
      col[static_cast<std::size_t>(t)] = cutoff(i) - detail::load_score(scores(i, j), opt.input);
    }
    std::nth_element(col.begin(), col.begin() + q, col.end());
    out[static_cast<std::size_t>(j)] = col[static_cast<std::size_t>(q)];
  }
  return true;
}

}  // namespace detail

// One causal per-step update with exact quantiles; args.bias must be the bias the batch was
// routed with (it is overwritten by the bias for the NEXT batch). Padding-only batches keep it.
template <HostBackend B, class T>
  requires std::same_as<T, float>
bool qb_exact_update(B const&, qb_exact_update_args<T> const& a, qb_update_options const& opt = {}) {
  detail::check_ema(opt.ema);
  auto const bias = a.bias;
  ::k3::detail::check_view("bias", bias);
  detail::check_shape("bias", bias, {a.scores.extent(1)});
  ::k3::detail::check_outputs_apart(::k3::detail::named_views("bias", bias),
                                    ::k3::detail::named_views("scores", a.scores, "cutoff", a.cutoff, "mask", a.mask));
  std::vector<double> b;
  if (!detail::qb_exact_quantile(a.scores, a.cutoff, opt.router, b, a.mask)) return false;
  detail::finish_bias(b, bias, opt.ema);
  return true;
}

// Which minimiser of a coordinate block the offline solver takes. Any alpha_i between the k-th
// and (k+1)-th largest of s_i - beta minimises the dual in alpha_i (likewise beta_j between the
// q-th and (q+1)-th of the column). `next` is Algorithm 1's literal convention; `midpoint`
// (default) stays inside that interval instead of on its edge, which keeps the alternation from
// stalling on a boundary: on m=4096, n=64, k=4 skewed scores it reaches max|load-q| < 1% of q in
// 12 iterations where `next` plateaus at 4-8% (tests/moe/test_quantile_balancing.cpp).
enum class qb_cut { midpoint, next };

// Inputs of the offline solver: one fixed batch, and the bias it writes.
template <class T>
struct qb_offline_args {
  const_view<T, 2> scores;                // [m, n]
  const_view<std::uint8_t, 1> mask = {};  // [m]  padding rows (0) are ignored
  tensor_view<float, 1> bias;             // [n]  written
};

struct qb_offline_options {
  router_options router{};
  index_t iterations = 12;  // converges in ~10 (spec A.4.1)
  qb_cut cut = qb_cut::midpoint;
};

// Algorithm 1 (offline, one fixed batch): T alternations of the closed-form alpha and beta
// updates from beta = 0, in double. Writes the centred bias b = -beta.
template <HostBackend B, class T>
  requires std::same_as<T, float>
void qb_offline_solve(B const&, qb_offline_args<T> const& a, qb_offline_options const& o = {}) {
  auto const scores = a.scores;
  auto const mask = a.mask;
  auto const bias = a.bias;
  router_options const& opt = o.router;
  index_t const iterations = o.iterations;
  qb_cut const cut = o.cut;
  ::k3::detail::check_view("scores", scores);
  index_t const m = scores.extent(0), n = scores.extent(1);
  detail::require(m > 0, error_kind::value, "argument 'scores': zero tokens");
  detail::require(opt.k >= 1 && opt.k < n, error_kind::value, [&] {
    return "argument 'k': need 1 <= k < n, got k = " + std::to_string(opt.k) + ", n = " + std::to_string(n);
  });
  detail::require(iterations >= 1, error_kind::value, [&] { return "argument 'iterations': must be >= 1, got " + std::to_string(iterations); });
  // Like the per-step updates: the solver ranks all n experts per token, which group-limited
  // routing would not do, so its bias would not balance the routing it is used with.
  detail::require(opt.n_groups == 1, error_kind::value, [&] { return detail::qb_groups_message(opt.n_groups); });
  ::k3::detail::check_view("bias", bias);
  detail::check_shape("bias", bias, {n});
  if (!mask.empty()) {
    ::k3::detail::check_view("mask", mask);
    detail::check_shape("mask", mask, {m});
  }
  ::k3::detail::check_outputs_apart(::k3::detail::named_views("bias", bias),
                                    ::k3::detail::named_views("scores", scores, "mask", mask));
  std::vector<index_t> rows;
  for (index_t i = 0; i < m; ++i)
    if (mask.empty() || mask(i) != 0) rows.push_back(i);
  index_t const mr = static_cast<index_t>(rows.size());
  detail::require(mr > 0, error_kind::value, "argument 'mask': every token is padding");
  index_t const q = mr * opt.k / n;
  std::vector<double> s(static_cast<std::size_t>(mr * n));
  for (index_t t = 0; t < mr; ++t)
    for (index_t j = 0; j < n; ++j) {
      float x = scores(rows[static_cast<std::size_t>(t)], j);
      detail::require(std::isfinite(x), error_kind::value, [&] { return detail::nonfinite_message(rows[static_cast<std::size_t>(t)], j, opt.input); });
      s[static_cast<std::size_t>(t * n + j)] = detail::load_score(x, opt.input);
    }
  std::vector<double> alpha(static_cast<std::size_t>(mr)), beta(static_cast<std::size_t>(n), 0.0), buf;
  for (index_t it = 0; it < iterations; ++it) {
    buf.resize(static_cast<std::size_t>(n));
    for (index_t t = 0; t < mr; ++t) {
      for (index_t j = 0; j < n; ++j) buf[j] = s[t * n + j] - beta[j];
      std::nth_element(buf.begin(), buf.begin() + opt.k, buf.end(), std::greater<>());
      alpha[t] = buf[opt.k];
      if (cut == qb_cut::midpoint) alpha[t] = 0.5 * (alpha[t] + *std::min_element(buf.begin(), buf.begin() + opt.k));
    }
    buf.resize(static_cast<std::size_t>(mr));
    for (index_t j = 0; j < n; ++j) {
      for (index_t t = 0; t < mr; ++t) buf[t] = s[t * n + j] - alpha[t];
      std::nth_element(buf.begin(), buf.begin() + q, buf.end(), std::greater<>());
      beta[j] = buf[q];
      if (cut == qb_cut::midpoint && q > 0) beta[j] = 0.5 * (beta[j] + *std::min_element(buf.begin(), buf.begin() + q));
    }
  }
  std::vector<double> b(static_cast<std::size_t>(n));
  for (index_t j = 0; j < n; ++j) b[j] = -beta[j];
  detail::finish_bias(b, bias, 0.0);
}

}  // namespace k3::moe
