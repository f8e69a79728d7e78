// k3 route — MoE routing with Quantile Balancing on .npy files.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include "cli.hpp"
#include "k3/moe.hpp"

namespace {

// float32 as is; float64 / bfloat16 converted (a float32 copy).
std::vector<float> as_float(k3::io::npy_array const& a, std::string const& name, std::size_t rank) {
  k3::cli::check(a.rank() == rank, k3::error_kind::shape, [&] {
    return "argument '" + name + "': expected rank " + std::to_string(rank) + ", got shape " + k3::format_shape(a.shape());
  });
  bool const bf16_bits = a.type() == k3::io::dtype::uint16;  // '<u2': PyTorch's bfloat16 dump (k3/io/npy.hpp)
  k3::cli::check(a.type() == k3::io::dtype::float32 || a.type() == k3::io::dtype::float64 || a.type() == k3::io::dtype::bfloat16 || bf16_bits, k3::error_kind::dtype,
                      [&] { return "argument '" + name + "': expected a float32/float64/bfloat16 array, got " + k3::io::dtype_name(a.type()); });
  std::vector<float> v(static_cast<std::size_t>(a.size()));
  for (k3::index_t i = 0; i < a.size(); ++i)
    v[static_cast<std::size_t>(i)] = bf16_bits ? float(k3::bfloat16::from_bits(static_cast<std::uint16_t>(a.as_int(i))))
                                               : static_cast<float>(a.as_double(i));
  return v;
}

int run_route_body(k3::cli::args& args) {
  namespace moe = k3::moe;
  moe::router_options opt;
  opt.k = args.integer("k", 16);
  double const scale = args.number("scale", 1.0);
  // Narrowing the typed number to the library's float32 is the tool's own step (NaN is left to
  // the library's check).
  if (std::isfinite(scale) && !std::isfinite(static_cast<float>(scale)))
    throw k3::cli::usage_error("option '--scale': " + args.value("scale") + " is outside the float32 range");
  opt.routed_scale = static_cast<float>(scale);
  opt.n_groups = args.integer("groups", 1);
  opt.topk_groups = args.integer("topk-groups", 1);
  auto scores_file = args.load_optional("scores");
  std::optional<k3::io::npy_array> input = scores_file;
  std::string in_name = "scores";
  auto logits_file = args.load_optional("logits");
  // Both present: which one to route on is a guess, so neither is picked silently.
  if (scores_file && logits_file)
    throw k3::error(k3::error_kind::io, "ambiguous input: both scores.npy and logits.npy are in " + args.value("in") + "; give one of them");
  if (!input) {
    input = std::move(logits_file);
    in_name = "logits";
    opt.input = moe::score_kind::logits;
  }
  if (!input) throw k3::error(k3::error_kind::io, "missing input: need scores.npy or logits.npy [m, n] in " + args.value("in"));
  std::vector<float> s = as_float(*input, in_name, 2);
  k3::index_t const m = input->shape()[0], n = input->shape()[1];
  // Before anything is sized from n (a zero-token file may declare 2^34 experts).
  k3::cli::check(m >= 1, k3::error_kind::shape, [&] { return "argument '" + in_name + "': zero tokens (shape " + k3::format_shape(input->shape()) + "); need m >= 1"; });
  std::vector<float> bias(static_cast<std::size_t>(n), 0.f);
  if (auto b = args.load_optional("bias")) {
    bias = as_float(*b, "bias", 1);
    k3::cli::check(static_cast<k3::index_t>(bias.size()) == n, k3::error_kind::shape, [&] {
      return "argument 'bias': expected shape [" + std::to_string(n) + "] (one entry per expert), got [" + std::to_string(bias.size()) + "]";
    });
  }
  std::vector<std::uint8_t> mask;
  if (auto mk = args.load_optional("mask")) {
    k3::cli::check(mk->rank() == 1 && mk->shape()[0] == m, k3::error_kind::shape, [&] {
      return "argument 'mask': expected shape [" + std::to_string(m) + "], got " + k3::format_shape(mk->shape());
    });
    mask.resize(static_cast<std::size_t>(m));
    for (k3::index_t i = 0; i < m; ++i) {
      double const v = mk->as_double(i);
      k3::cli::check(std::isfinite(v), k3::error_kind::value, [&] { return "argument 'mask': non-finite value at token " + std::to_string(i); });
      mask[static_cast<std::size_t>(i)] = v != 0 ? 1 : 0;
    }
  }
  k3::const_view<std::uint8_t, 1> mv = mask.empty() ? k3::const_view<std::uint8_t, 1>{} : k3::const_view<std::uint8_t, 1>(mask.data(), {m});
  k3::const_view<float, 2> sv(s.data(), {m, n});
  k3::index_t const bins = args.integer_in("bins", 1000, 1, k3::index_t(1) << 20);
  std::string const update = args.choice("update", {"histogram", "exact"});
  double const ema = args.number("ema", 0.0);
  k3::cpu::threads<> backend(args.threads(0));

  // The library's checks of the options, made before anything is sized from k.
  moe::check_router_options(opt, n);
  // Options that only one mode reads are errors elsewhere, not silently dropped: --solve runs no
  // per-batch update (the solver routes with its own bias), --groups > 1 has no Quantile Balancing,
  // --iterations is the solver's and --bins the histogram's.
  bool const solve = args.flag("solve");
  if (!solve && args.has("iterations")) throw k3::cli::usage_error("option '--iterations' applies only with --solve");
  for (char const* o : {"update", "bins", "ema"}) {
    if (solve && args.has(o))
      throw k3::cli::usage_error(std::string("option '--") + o +
                                 "' does not apply with --solve (the offline solver routes with its own bias and writes it as new_bias.npy)");
    if (opt.n_groups > 1 && args.has(o))
      throw k3::cli::usage_error(std::string("option '--") + o + "' does not apply with --groups " + std::to_string(opt.n_groups) +
                                 " (no Quantile Balancing for group-limited routing: new_bias.npy is the input bias)");
  }
  if (solve && opt.n_groups > 1)
    throw k3::cli::usage_error("option '--solve' does not apply with --groups " + std::to_string(opt.n_groups) +
                               " (Quantile Balancing does not cover group-limited routing)");
  if (args.has("bins") && update != "histogram") throw k3::cli::usage_error("option '--bins' applies only to --update histogram");
  std::vector<float> new_bias = bias;
  if (solve) {
    // Offline solver on this batch; then route with the solved bias.
    // Bounded: each iteration is O(m n); the solver converges in ~10 (spec A.4.1).
    k3::index_t const it = args.integer_in("iterations", 12, 1, 10000);
    moe::qb_offline_solve(backend, moe::qb_offline_args<float>{.scores = sv, .mask = mv, .bias = k3::host_view(new_bias.data(), n)},
                         {.router = opt, .iterations = it});
    bias = new_bias;
  }
  std::vector<std::int32_t> idx(static_cast<std::size_t>(m * opt.k));
  std::vector<float> w(idx.size()), cut(static_cast<std::size_t>(m));
  std::vector<std::int64_t> load(static_cast<std::size_t>(n));
  k3::const_view<float, 1> bv(bias.data(), {n});
  moe::route_args<float> out{.scores = sv,
                             .bias = bv,
                             .mask = mv,
                             .indices = k3::host_view(idx.data(), m, opt.k),
                             .weights = k3::host_view(w.data(), m, opt.k),
                             .cutoff = k3::host_view(cut.data(), m),
                             .load = k3::host_view(load.data(), n)};
  if (!solve) {
    if (opt.n_groups > 1) {
      // QB does not cover group-limited routing: route only, the bias is kept.
      moe::route(backend, out, opt);
    } else if (update == "histogram") {
      // Spec A.4.3/A.7: the histogram range [min b - 1, max b + 1] holds every margin only for
      // scores in [0, 1]; outside it the margins would be clamped into the end bins (a wrong bias).
      if (opt.input == moe::score_kind::scores)
        for (k3::index_t i = 0; i < m * n; ++i)
          if ((mask.empty() || mask[static_cast<std::size_t>(i / n)]) && !(s[static_cast<std::size_t>(i)] >= 0.f && s[static_cast<std::size_t>(i)] <= 1.f) && std::isfinite(s[static_cast<std::size_t>(i)]))
            throw k3::error(k3::error_kind::value, "argument 'scores': --update histogram needs router probabilities in [0, 1], got " +
                            std::to_string(s[static_cast<std::size_t>(i)]) + " at [" + std::to_string(i / n) + ", " + std::to_string(i % n) +
                            "] (use --update exact, or give logits.npy)");
      // The bins span [min(b) - 1, max(b) + 1] in float32: with |b| >= ~1e7 that range is empty
      // (b - 1 == b) and near FLT_MAX its width overflows. Said here in the option's terms (the
      // library's message names its own bounds).
      if (std::all_of(bias.begin(), bias.end(), [](float x) { return std::isfinite(x); })) {
        float const lo = *std::min_element(bias.begin(), bias.end()) - 1.f, hi = *std::max_element(bias.begin(), bias.end()) + 1.f;
        float const inv_w = float(bins) / (hi - lo);
        if (!(hi > lo && std::isfinite(inv_w) && inv_w > 0.f))
          throw k3::error(k3::error_kind::value, "argument 'bias': --update histogram bins the margins over [min(bias) - 1, max(bias) + 1] = [" + std::to_string(lo) +
                          ", " + std::to_string(hi) + "] in float32, which cannot be split into " + std::to_string(bins) +
                          " bins (use --update exact)");
      }
      auto hist = moe::qb_histogram::for_bias(bv, bins);
      out.histogram = &hist;
      moe::route(backend, out, opt);
      moe::qb_update(backend, moe::qb_update_args<float>{.histogram = &hist, .bias = k3::host_view(new_bias.data(), n)}, {.router = opt, .ema = ema});
    } else {
      moe::route(backend, out, opt);
      moe::qb_exact_update(backend,
                           moe::qb_exact_update_args<float>{.scores = sv, .cutoff = k3::const_view<float, 1>(cut.data(), {m}), .mask = mv,
                                                            .bias = k3::host_view(new_bias.data(), n)},
                           {.router = opt, .ema = ema});
    }
  } else {
    moe::route(backend, out, opt);
  }
  args.save("indices", out.indices);
  args.save("weights", out.weights);
  args.save("load", out.load);
  args.save("new_bias", k3::host_view(new_bias.data(), n));
  double q = 0, worst = 0;
  std::int64_t real = mask.empty() ? m : 0;
  for (auto x : mask) real += x;
  q = double(real) * double(opt.k) / double(n);
  for (auto l : load) worst = std::max(worst, std::abs(double(l) - q));
  std::printf("routed %lld tokens to %lld of %lld experts; max |load - q| = %.1f (q = %.1f)\n", static_cast<long long>(real),
              static_cast<long long>(opt.k), static_cast<long long>(n), worst, q);
  return 0;
}

int run_route(k3::cli::args& args) {
  return k3::cli::with_option_spellings(
      {{"k", "k"}, {"routed_scale", "scale"}, {"n_groups", "groups"}, {"topk_groups", "topk-groups"}, {"ema", "ema"}},
      [&] { return run_route_body(args); });
}

k3::cli::registrar reg({"route", "MoE top-k routing with Quantile Balancing (sigmoid scores + bias)",
                        "Reads <in>/scores.npy [m, n] (router probabilities) or <in>/logits.npy (sigmoid applied), optional\n"
                        "bias.npy [n] (default 0) and mask.npy [m] (nonzero = real token). Routes with top-k of s + b\n"
                        "(ties: lower expert index), weights from s renormalised x scale. Writes indices.npy [m, k] int32\n"
                        "(-1 for padding), weights.npy [m, k], load.npy [n] int64 and new_bias.npy [n]: the Quantile-\n"
                        "Balancing bias for the NEXT batch (this batch is routed with the old one). With --solve, runs the\n"
                        "offline solver on this batch (from a zero bias: bias.npy is not used), routes with its bias and writes it\n"
                        "as new_bias.npy. --update/--bins/--ema are errors with --solve or --groups > 1, --iterations without\n"
                        "--solve and --bins with --update exact (options that would otherwise be ignored).",
                        k3::cli::io_options({{"k", true, "experts per token (default 16)"},
                                             {"scale", true, "routed scaling factor (default 1.0)"},
                                             {"bins", true, "histogram bins (default 1000)"},
                                             {"update", true, "histogram|exact (default histogram; histogram needs scores in [0, 1])"},
                                             {"ema", true, "EMA coefficient for the bias update in [0, 1) (default 0)"},
                                             {"groups", true, "expert groups for group-limited routing (default 1: off; no QB)"},
                                             {"topk-groups", true, "groups kept per token (default 1)"},
                                             {"solve", false, "run the offline QB solver on this batch"},
                                             {"iterations", true, "offline solver iterations in [1, 10000] (default 12)"},
                                             {"threads", true, "worker threads (default: all)"}}),
                        true, run_route});

}  // namespace
