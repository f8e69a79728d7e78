// k3/attnres/block.hpp — the model-agnostic Block AttnRes driver (spec §3, §5.3).
//
// The driver owns the source bank (preallocated [n_max, T, d] plus a valid count), the running
// partial sum of the current block, and the per-site bookkeeping. The model loop is:
//
//     ar.begin(embedding);
//     for (l = 0; l < L; ++l) { ar.input(x); y = sublayer_l(x); ar.add(y); }
//     ar.output(out);                             // the output-head mix, before the final norm
//
// (add_input(y, x) = add(y) then input(x); fused into one pass in two-phase mode.)
//
// Sites are numbered 0..L (site L is the output head); every attention and every MLP/MoE is
// one sublayer. At a site with l % S == 0 (S = block size in sublayers) the running sum is
// closed and pushed to the bank first (at l = 0 that pushes the embedding, b_0); the site then
// mixes the bank alone. Every other site mixes the bank plus the partial sum. This is Eq. 6 of
// the paper and K3's control flow (K3 mixes before the push over snapshots ++ [prefix], which
// is the same source set). K3 counts decoder layers: attn_res_block_size = 12 is S = 24.
// With S = 1 the driver is Full AttnRes.
//
// K3's decoder layer 0 rule (skip_first_mix): site 0's input is the embedding itself; its
// query and gain exist but are unused (their gradients are zero).
//
// Modes: one_pass (inference, one mix per site), two_phase (inference: phase 1 for all sites
// of a block at the block's first site, phase 2 per site), train_stored (keeps partial sums
// and the per-token softmax statistics for the backward), train_recompute (keeps only the
// block sums and partial sums; the backward recomputes the statistics — same gradients bit
// for bit).
//
// Training through a saved-tensor store: save_sites_through(site_saves) hands each site's
// partial sum and softmax statistics to the caller's functions instead of the driver's own
// buffers (k3::train::attnres_site_saves binds them to a k3::train::saved_tensor_store under
// any policy); the backward loads each once. Without save_stats the statistics are recomputed,
// as in train_recompute. The gradients are those of train_stored whenever the loads give back
// what was saved.
//
// Backward (training modes), sites in reverse:
//     ar.backward_begin();
//     ar.backward_site(d_out);                        // site L: gradient of the output mix
//     for (l = L - 1; l >= 0; --l) {
//       dy = ar.grad_sublayer_output();               // dLoss/dy_l
//       dx = sublayer_l backward(dy);  ar.backward_site(dx);
//     }
//     ar.grad_embedding();  ar.grad_w();  ar.grad_gain();
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "k3/attnres/mix.hpp"
#include "k3/attnres/two_phase.hpp"
#include "k3/core/storage.hpp"
#include "k3/core/tensor.hpp"

namespace k3::attnres {

enum class mode { one_pass, two_phase, train_stored, train_recompute };

// Where a training pass keeps what each site's backward reads (see save_sites_through). A save
// returns an id the matching load gets back; release drops a saved entry a new pass replaces.
template <class S, class C>
struct site_saves {
  std::function<std::uint64_t(tensor_view<S const, 2>)> save_partial;  // the running sum [T, d]
  std::function<void(std::uint64_t, tensor_view<S, 2>)> load_partial;
  std::function<std::uint64_t(tensor_view<C const, 3>)> save_stats;  // [T, sources, 3]; empty: recomputed
  std::function<void(std::uint64_t, tensor_view<C, 3>)> load_stats;
  std::function<void(std::uint64_t)> release;
};

struct block_config {
  index_t d = 0;                // model width
  index_t tokens = 0;           // token capacity T (begin() may use fewer)
  index_t sublayers = 0;        // L (attention and MLP each count)
  index_t block_sublayers = 0;  // S, the block size in sublayers (1 = Full AttnRes)
  double eps = 1e-5;            // the key RMSNorm's eps
  bool skip_first_mix = true;   // K3: decoder layer 0's attention input is the embedding
  mode run_mode = mode::one_pass;

  // K3 counts blocks in decoder layers (attention + MLP = 2 sublayers).
  static constexpr index_t sublayers_from_decoder_layers(index_t layers) noexcept { return 2 * layers; }

  // Kimi K3: 93 decoder layers, d = 7168, attn_res_block_size = 12, rms_norm_eps = 1e-5.
  static block_config kimi_k3(index_t tokens, mode m = mode::one_pass) {
    block_config c;
    c.d = 7168;
    c.tokens = tokens;
    c.sublayers = sublayers_from_decoder_layers(93);
    c.block_sublayers = sublayers_from_decoder_layers(12);
    c.run_mode = m;
    return c;
  }

  // Bank rows pushed over a whole pass: one at every site l in [0, L] with l % S == 0.
  index_t max_blocks() const noexcept { return block_sublayers > 0 ? sublayers / block_sublayers + 1 : 0; }
  // Rows of the bank a site mixes, and whether it also mixes the partial sum (0 / false for a
  // config without a valid block size, which the driver rejects, instead of a division by 0).
  index_t bank_rows_at(index_t site) const noexcept { return block_sublayers > 0 ? site / block_sublayers + 1 : 0; }
  bool partial_at(index_t site) const noexcept { return block_sublayers > 0 && site % block_sublayers != 0; }
  index_t sources_at(index_t site) const noexcept { return bank_rows_at(site) + (partial_at(site) ? 1 : 0); }
};

template <class S, HostBackend B = cpu::serial>
class block_attn_res {
 public:
  using storage_type = S;
  using compute_type = k3::accumulation_t<S>;
  using C = compute_type;

  // w, gain: [L + 1, d], one pseudo-query and one key-norm gain per site (row L: output head).
  block_attn_res(block_config cfg, tensor_view<C const, 2> w, tensor_view<C const, 2> gain, B backend = B{})
      : cfg_(cfg), w_(w), g_(gain), b_(std::move(backend)) {
    static_assert(Storage<S>, "block_attn_res: storage must be float, double or bfloat16");
    detail::require(cfg.d >= 1, error_kind::value, [&] { return "block_config: d must be >= 1, got " + std::to_string(cfg.d); });
    detail::require(cfg.tokens >= 0, error_kind::value, [&] { return "block_config: tokens must be >= 0, got " + std::to_string(cfg.tokens); });
    detail::require(cfg.sublayers >= 0, error_kind::value, [&] { return "block_config: sublayers must be >= 0, got " + std::to_string(cfg.sublayers); });
    detail::require(cfg.block_sublayers >= 1, error_kind::value,
                    [&] { return "block_config: block_sublayers must be >= 1, got " + std::to_string(cfg.block_sublayers); });
    detail::require(cfg.eps >= 0 && std::isfinite(cfg.eps), error_kind::value, [&] { return "block_config: eps must be finite and >= 0, got " + std::to_string(cfg.eps); });
    detail::check_view("w", w);
    detail::check_view("gain", gain);
    detail::check_shape("w", w, {cfg.sublayers + 1, cfg.d});
    detail::check_shape("gain", gain, {cfg.sublayers + 1, cfg.d});
    detail::check_inner_contiguous("w", w);
    detail::check_inner_contiguous("gain", gain);
    index_t const nmax = cfg.max_blocks();
    bank_ = tensor<S, 3, B>({nmax, cfg.tokens, cfg.d}, b_);
    rinv_ = tensor<C, 2, B>({nmax, cfg.tokens}, b_);
    prefix_ = tensor<S, 2, B>({cfg.tokens, cfg.d}, b_);
    if (cfg.run_mode == mode::two_phase) {
      index_t const S_ = std::min(cfg.block_sublayers, cfg.sublayers + 1);
      o_ = tensor<C, 3, B>({S_, cfg.tokens, cfg.d}, b_);
      lse_ = tensor<C, 2, B>({S_, cfg.tokens}, b_);
      u_ = tensor<C, 2, B>({S_, cfg.d}, b_);
    }
    if (training()) {
      saved_partial_.resize(std::size_t(cfg.sublayers + 1));
      saved_stats_.resize(std::size_t(cfg.sublayers + 1));
    }
  }

  // Training: each site's partial sum and statistics go to s's functions (save_partial and
  // load_partial are required; without save_stats the backward recomputes the statistics).
  void save_sites_through(site_saves<S, C> s) {
    detail::require(training(), error_kind::unsupported, "block_attn_res::save_sites_through: the driver was not built in a training mode");
    detail::require(s.save_partial && s.load_partial && s.release, error_kind::value, "block_attn_res::save_sites_through: save_partial, load_partial and release are required");
    detail::require(!s.save_stats == !s.load_stats, error_kind::value, "block_attn_res::save_sites_through: save_stats and load_stats come together");
    saves_ = std::move(s);
    held_partial_.assign(std::size_t(cfg_.sublayers + 1), 0);
    held_stats_.assign(std::size_t(cfg_.sublayers + 1), 0);
  }

  block_config const& config() const noexcept { return cfg_; }
  bool training() const noexcept { return cfg_.run_mode == mode::train_stored || cfg_.run_mode == mode::train_recompute; }
  index_t site() const noexcept { return l_; }               // the next site input() serves
  index_t bank_count() const noexcept { return n_; }         // valid bank rows
  index_t tokens() const noexcept { return T_; }
  // Sources the next input() mixes (after the boundary push it performs).
  index_t next_source_count() const noexcept { return cfg_.sources_at(l_); }

  tensor_view<S const, 3> bank() const noexcept { return bank_.view().sub(0, 0, n_).sub(1, 0, T_); }
  tensor_view<C const, 2> bank_rinv() const noexcept { return rinv_.view().sub(0, 0, n_).sub(1, 0, T_); }
  tensor_view<S const, 2> partial() const noexcept { return prefix_.view().sub(0, 0, T_); }

  // Starts a forward pass: the embedding [T, d] (T <= the token capacity) is the running sum.
  template <class E>
  void begin(tensor_view<E, 2> embedding) {
    static_assert(std::is_same_v<std::remove_const_t<E>, S>, "begin: the embedding has the storage type");
    detail::check_view("embedding", embedding);
    detail::check_shape("embedding", embedding, {detail::any_extent, cfg_.d});
    detail::require(embedding.extent(0) <= cfg_.tokens, error_kind::shape, [&] {
      return "argument 'embedding': " + std::to_string(embedding.extent(0)) + " tokens exceed the driver's capacity of " +
             std::to_string(cfg_.tokens);
    });
    T_ = embedding.extent(0);
    copy_rows(embedding, cur_prefix());
    n_ = 0;
    l_ = 0;
    prefix_empty_ = false;
    output_done_ = false;
    awaiting_add_ = false;  // a pass abandoned after an input() does not let add() skip site 0
    bl_ = -1;               // nor a backward abandoned half-way continue on this pass's state
  }

  // Writes the input of site l = site() into x [T, d]. Closes the block first at a boundary.
  template <class X>
  void input(tensor_view<X, 2> x) {
    detail::require(T_ >= 0 && l_ <= cfg_.sublayers && !output_done_, error_kind::value, [&] {
      return "block_attn_res::input: no site left (site " + std::to_string(l_) + " of " + std::to_string(cfg_.sublayers) + ")";
    });
    // A second input() for the same site would close the block at a boundary twice (a
    // duplicated bank row, every later site mixing the wrong sources).
    detail::require(!awaiting_add_, error_kind::value, [&] {
      return "block_attn_res::input: site " + std::to_string(l_) + " already handed out its input; call add() with its output first";
    });
    detail::check_view("x", x);
    detail::check_shape("x", x, {T_, cfg_.d});
    detail::check_not_broadcast("x", x);
    index_t const l = l_;
    bool const boundary = !cfg_.partial_at(l);
    if (boundary) push_block();
    if (cfg_.skip_first_mix && l == 0) {
      copy_rows(bank_.view().slice(0, 0).sub(0, 0, T_), x);
    } else if (cfg_.run_mode == mode::two_phase) {
      index_t const i = l - block_start_;
      auto xo = o_.view().slice(0, i).sub(0, 0, T_);
      auto xl = lse_.view().slice(0, i).sub(0, 0, T_);
      phase2(
          b_,
          phase2_args<S, C, X>{.o = xo, .lse = xl, .partial = boundary ? tensor_view<S const, 2>{} : partial(), .u = u_.view().slice(0, i), .h = x},
          {.eps = cfg_.eps});
    } else {
      auto src = boundary ? make_sources(bank()) : make_sources(bank(), partial());
      options opt;
      opt.eps = cfg_.eps;
      stats_view<C> st{};
      if (training() && saves_.save_partial) {
        std::size_t const i = std::size_t(l);
        // A new pass replaces what an earlier one saved and never loaded.
        for (auto* h : {&held_partial_[i], &held_stats_[i]})
          if (*h) saves_.release(std::exchange(*h, 0) - 1);
        if (!boundary) held_partial_[i] = saves_.save_partial(partial()) + 1;
        if (saves_.save_stats) {
          stats_ws_ = tensor<C, 3, B>({T_, src.count(), 3}, b_);
          st = stats_ws_.view();
        }
      } else if (training()) {
        if (!boundary) {
          auto& sp = saved_partial_[std::size_t(l)];
          if (sp.extent(0) != T_ || sp.extent(1) != cfg_.d) sp = tensor<S, 2, B>({T_, cfg_.d}, b_);  // also T = 0 on first use
          copy_rows(partial(), sp.view());
        }
        if (cfg_.run_mode == mode::train_stored) {
          auto& ss = saved_stats_[std::size_t(l)];
          if (ss.extent(0) != T_ || ss.extent(1) != src.count()) ss = tensor<C, 3, B>({T_, src.count(), 3}, b_);
          st = ss.view();
        }
      }
      mix_forward(b_, mix_forward_args<S, C, X>{.sources = src, .w = w_.slice(0, l), .gain = g_.slice(0, l), .h = x, .stats = st}, opt);
      if (training() && saves_.save_stats) {
        held_stats_[std::size_t(l)] = saves_.save_stats(tensor_view<C const, 3>(stats_ws_.view())) + 1;
        stats_ws_ = {};
      }
    }
    if (l == cfg_.sublayers) output_done_ = true;
    awaiting_add_ = l < cfg_.sublayers;
  }

  // The output-head mix (site L), before the final norm.
  template <class X>
  void output(tensor_view<X, 2> x) {
    detail::require(l_ == cfg_.sublayers && !awaiting_add_ && !output_done_, error_kind::value, [&] {
      return "block_attn_res::output: the output mix comes after all " + std::to_string(cfg_.sublayers) +
             " sublayers; at site " + std::to_string(l_);
    });
    input(x);
  }

  // Adds sublayer l's output y [T, d] into the running sum and moves to site l + 1.
  template <class Y>
  void add(tensor_view<Y, 2> y) {
    detail::require(awaiting_add_, error_kind::value, "block_attn_res::add: call input() for the site first");
    detail::check_view("y", y);
    detail::check_shape("y", y, {T_, cfg_.d});
    auto p = cur_prefix();
    bool const fresh = prefix_empty_;
    detail::check_inner_contiguous("y", y);
    b_.for_each(0, T_, [&](index_t t) {
      S* K3_RESTRICT pr = &p(t, 0);
      auto const* K3_RESTRICT yr = &y(t, 0);
      if (fresh)
        for (index_t k = 0; k < cfg_.d; ++k) detail::put(pr[k], detail::to_c<C>(yr[k]));
      else
        for (index_t k = 0; k < cfg_.d; ++k) detail::put(pr[k], detail::to_c<C>(pr[k]) + detail::to_c<C>(yr[k]));
    });
    prefix_empty_ = false;
    awaiting_add_ = false;
    ++l_;
  }

  // add(y) followed by input(x). In two-phase mode, inside a block, this is one fused pass
  // (phase2_add: the residual add and the merge read the running sum once).
  template <class Y, class X>
  void add_input(tensor_view<Y, 2> y, tensor_view<X, 2> x) {
    detail::check_not_broadcast("x", x);  // before add() moves the driver on
    index_t const next = l_ + 1;
    // x may be y's own buffer (the next input written over the sublayer output, as add then
    // input allows); the fused pass reads y while it writes x, so it runs only on separate
    // buffers.
    std::uintptr_t x0, x1, y0, y1;
    detail::byte_range(x, x0, x1);
    detail::byte_range(y, y0, y1);
    bool const apart = !(x0 < x1 && y0 < y1 && x0 < y1 && y0 < x1);
    bool const fusable = cfg_.run_mode == mode::two_phase && awaiting_add_ && !prefix_empty_ && next <= cfg_.sublayers &&
                         cfg_.partial_at(next) && apart;
    if (!fusable) {
      add(y);
      input(x);
      return;
    }
    detail::check_view("y", y);
    detail::check_shape("y", y, {T_, cfg_.d});
    detail::check_view("x", x);
    detail::check_shape("x", x, {T_, cfg_.d});
    index_t const i = next - block_start_;
    using Y_ = std::remove_const_t<typename decltype(y)::element_type>;
    using X_ = typename decltype(x)::element_type;
    phase2_add(b_,
               phase2_add_args<S, Y_, C, X_>{.o = o_.view().slice(0, i).sub(0, 0, T_),
                                             .lse = lse_.view().slice(0, i).sub(0, 0, T_),
                                             .prefix = cur_prefix(),
                                             .delta = y,
                                             .u = u_.view().slice(0, i),
                                             .h = x},
               {.eps = cfg_.eps});
    l_ = next;
    if (l_ == cfg_.sublayers) output_done_ = true;
    awaiting_add_ = l_ < cfg_.sublayers;
  }

  // ---- backward (training modes) ----------------------------------------------------------

  void backward_begin() {
    detail::require(output_done_, error_kind::value, "block_attn_res::backward_begin: run the forward through output() first");
    backward_prepare();
    bl_ = cfg_.sublayers;
  }

  // Allocates and zeroes the gradient buffers (backward_begin does it; a pipeline stage that
  // does not hold the output site calls it before its first backward hop).
  void backward_prepare() {
    detail::require(training(), error_kind::unsupported, "block_attn_res::backward: the driver was not built in a training mode");
    if (dbank_.extent(1) != T_ || dbank_.extent(2) != cfg_.d) {  // also T = 0 on first use
      dbank_ = tensor<C, 3, B>({cfg_.max_blocks(), T_, cfg_.d}, b_);
      grad_ = tensor<C, 2, B>({T_, cfg_.d}, b_);
    }
    if (dw_.size() == 0) {
      dw_ = tensor<C, 2, B>({cfg_.sublayers + 1, cfg_.d}, b_);
      dg_ = tensor<C, 2, B>({cfg_.sublayers + 1, cfg_.d}, b_);
    }
    fill(dbank_.view());
    fill(grad_.view());
    fill(dw_.view());
    fill(dg_.view());
    bl_ = -1;
  }

  // Gradient of the loss w.r.t. the input the driver handed out at site l = next_backward_site().
  template <class DH>
  void backward_site(tensor_view<DH, 2> dh) {
    detail::require(training() && bl_ >= 0, error_kind::value, "block_attn_res::backward_site: no site left (call backward_begin first)");
    detail::check_view("dh", dh);
    detail::check_shape("dh", dh, {T_, cfg_.d});
    index_t const l = bl_;
    index_t const nl = cfg_.bank_rows_at(l);
    bool const has_partial = cfg_.partial_at(l);
    if (!(cfg_.skip_first_mix && l == 0)) {
      auto bankv = bank_.view().sub(0, 0, nl).sub(1, 0, T_);
      tensor_view<S const, 2> part = has_partial ? tensor_view<S const, 2>(saved_partial_[std::size_t(l)].view()) : tensor_view<S const, 2>{};
      stats_view<C const> st{};
      if (saves_.save_partial) {
        std::size_t const i = std::size_t(l);
        if (has_partial) {
          detail::require(held_partial_[i] != 0, error_kind::value, [&] { return "block_attn_res::backward_site: nothing saved for site " + std::to_string(l); });
          partial_ws_ = tensor<S, 2, B>({T_, cfg_.d}, b_);
          saves_.load_partial(std::exchange(held_partial_[i], 0) - 1, partial_ws_.view());
          part = partial_ws_.view();
        }
        if (saves_.save_stats) {
          detail::require(held_stats_[i] != 0, error_kind::value, [&] { return "block_attn_res::backward_site: nothing saved for site " + std::to_string(l); });
          stats_ws_ = tensor<C, 3, B>({T_, nl + (has_partial ? 1 : 0), 3}, b_);
          saves_.load_stats(std::exchange(held_stats_[i], 0) - 1, stats_ws_.view());
          st = stats_ws_.view();
        }
      } else if (cfg_.run_mode == mode::train_stored) {
        st = saved_stats_[std::size_t(l)].view();
      }
      auto src = has_partial ? make_sources(bankv, part) : make_sources(bankv);
      options opt;
      opt.eps = cfg_.eps;
      opt.accumulate = true;
      auto grads = make_grads(dbank_.view().sub(0, 0, nl), grad_.view());
      mix_backward(b_,
                   mix_backward_args<S, C, std::remove_const_t<DH>, C, C>{.sources = src,
                                                                          .w = w_.slice(0, l),
                                                                          .gain = g_.slice(0, l),
                                                                          .d_h = dh,
                                                                          .d_sources = grads,
                                                                          .d_w = dw_.view().slice(0, l),
                                                                          .d_gain = dg_.view().slice(0, l),
                                                                          .stats = st},
                   opt);
    } else {
      // site 0 is the embedding itself: the gradient flows straight into bank row 0
      auto d0 = dbank_.view().slice(0, 0);
      b_.for_each(0, T_, [&](index_t t) {
        for (index_t k = 0; k < cfg_.d; ++k) d0(t, k) += detail::to_c<C>(dh(t, k));
      });
    }
    // Leaving the site: the running sum before it. At a boundary that is the block just closed
    // (bank row nl - 1), whose gradient is now complete: every reader lies at a later site.
    if (!has_partial) copy_rows(tensor_view<C const, 2>(dbank_.view().slice(0, nl - 1)), grad_.view());
    --bl_;
  }

  index_t next_backward_site() const noexcept { return bl_; }
  // After backward_site(l), l >= 1: dLoss/dy_{l-1}, the gradient of sublayer l-1's output.
  tensor_view<C const, 2> grad_sublayer_output() const noexcept { return grad_.view(); }
  // After backward_site(0): the gradient of the embedding.
  tensor_view<C const, 2> grad_embedding() const noexcept { return grad_.view(); }
  tensor_view<C const, 2> grad_w() const noexcept { return dw_.view(); }
  tensor_view<C const, 2> grad_gain() const noexcept { return dg_.view(); }

  // ---- pipeline support: state transfer between stages ------------------------------------
  // Mutable access used by pipeline_cache: the bank rows, their rinv, the running sum, and the
  // gradient buffers of the bank and of the running sum.
  tensor_view<S, 3> bank_storage() noexcept { return bank_.view(); }
  tensor_view<C, 2> rinv_storage() noexcept { return rinv_.view(); }
  tensor_view<S, 2> prefix_storage() noexcept { return cur_prefix(); }
  tensor_view<C, 3> dbank_storage() noexcept { return dbank_.view(); }
  tensor_view<C, 2> grad_storage() noexcept { return grad_.view(); }
  // Resumes a forward pass at `site` with n bank rows (filled by the caller) and the running sum.
  void resume(index_t site, index_t n, index_t T, bool prefix_empty) {
    detail::require(site >= 0 && site <= cfg_.sublayers && n == (site == 0 ? 0 : cfg_.bank_rows_at(site - 1)) && T <= cfg_.tokens, error_kind::value,
                    [&] { return "block_attn_res::resume: inconsistent state (site " + std::to_string(site) + ", bank rows " + std::to_string(n) + ")"; });
    l_ = site;
    n_ = n;
    T_ = T;
    prefix_empty_ = prefix_empty;
    output_done_ = false;
    awaiting_add_ = false;
    bl_ = -1;
    if (cfg_.run_mode == mode::two_phase && site % cfg_.block_sublayers != 0 && n > 0) start_phase1(site - site % cfg_.block_sublayers);
  }
  bool prefix_empty() const noexcept { return prefix_empty_; }
  // Resumes a backward pass at `site` (the gradient buffers hold the caller's state). Site -1:
  // nothing left to run here (a stage whose chunk was empty, its first site 0): the received
  // running-sum gradient is the embedding's.
  void resume_backward(index_t site) {
    detail::require(training() && dbank_.extent(1) == T_ && dbank_.extent(2) == cfg_.d && site >= -1 && site <= cfg_.sublayers, error_kind::value, [&] {
      return "block_attn_res::resume_backward: call backward_prepare() first (site " + std::to_string(site) + ")";
    });
    bl_ = site;
  }
  // Sets the token count of an incoming pipeline state before its rows are received.
  void resume_tokens(index_t T) {
    detail::require(T >= 0 && T <= cfg_.tokens, error_kind::value, [&] { return "block_attn_res: " + std::to_string(T) + " tokens exceed the capacity"; });
    T_ = T;
  }

 private:
  tensor_view<S, 2> cur_prefix() noexcept { return prefix_.view().sub(0, 0, T_); }

  void push_block() {
    detail::require(n_ < bank_.extent(0), error_kind::value, [&] {
      return "block_attn_res: bank full (" + std::to_string(bank_.extent(0)) + " rows) at site " + std::to_string(l_);
    });
    auto row = bank_.view().slice(0, n_).sub(0, 0, T_);
    copy_rows(partial(), row);
    if (cfg_.run_mode == mode::two_phase)
      block_rinv(b_, block_rinv_args<S>{.block = row, .rinv = rinv_.view().slice(0, n_).sub(0, 0, T_)}, {.eps = cfg_.eps});
    ++n_;
    prefix_empty_ = true;
    if (cfg_.run_mode == mode::two_phase) start_phase1(l_);
  }

  // Phase 1 for the sites [l0, min(l0 + S, L + 1)) against the current bank.
  void start_phase1(index_t l0) {
    block_start_ = l0;
    index_t const nq = std::min(cfg_.block_sublayers, cfg_.sublayers + 1 - l0);
    auto u = u_.view();
    for (index_t i = 0; i < nq; ++i)
      for (index_t k = 0; k < cfg_.d; ++k) u(i, k) = w_(l0 + i, k) * g_(l0 + i, k);
    phase1(b_, phase1_args<S, C>{.bank = bank(),
                                 .bank_rinv = bank_rinv(),
                                 .u = u.sub(0, 0, nq),
                                 .o = o_.view().sub(0, 0, nq).sub(1, 0, T_),
                                 .lse = lse_.view().sub(0, 0, nq).sub(1, 0, T_)});
  }

  template <class V, class W>
  void copy_rows(V src, W dst) {
    b_.for_each(0, src.extent(0), [&](index_t t) {
      for (index_t k = 0; k < src.extent(1); ++k) detail::put(dst(t, k), detail::to_c<C>(src(t, k)));
    });
  }
  template <class V>
  static void fill(V v) {
    if (v.size() > 0) std::fill(v.data_handle(), v.data_handle() + v.size(), typename V::value_type(0));
  }

  block_config cfg_;
  tensor_view<C const, 2> w_, g_;
  B b_;
  tensor<S, 3, B> bank_;
  tensor<C, 2, B> rinv_;
  tensor<S, 2, B> prefix_;
  tensor<C, 3, B> o_;
  tensor<C, 2, B> lse_, u_;
  std::vector<tensor<S, 2, B>> saved_partial_;
  std::vector<tensor<C, 3, B>> saved_stats_;
  site_saves<S, C> saves_;
  std::vector<std::uint64_t> held_partial_, held_stats_;  // per site: saved id + 1, 0 = none
  tensor<S, 2, B> partial_ws_;                            // the loaded partial sum of a backward site
  tensor<C, 3, B> stats_ws_;                              // statistics being saved or loaded
  tensor<C, 3, B> dbank_;
  tensor<C, 2, B> grad_, dw_, dg_;
  index_t n_ = 0, l_ = 0, T_ = -1, block_start_ = 0, bl_ = -1;
  bool prefix_empty_ = false, output_done_ = false, awaiting_add_ = false;
};

}  // namespace k3::attnres
