// k3 train-step — one training step of a small KDA + MoE stack with every saved tensor under
// one policy preset (k3/train/stack.hpp), and what the saved-tensor store held.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "cli.hpp"
#include "k3/train/stack.hpp"
#include "sha256.hpp"

namespace {

namespace train = k3::train;

std::string checksum(train::named_tensors<float> const& g) {
  k3::cli::sha256 h;
  for (auto const& v : g.values) h.update(v.data(), v.size() * sizeof(float));
  return h.hex();
}

// Relative RMS of all gradients concatenated, against the reference's.
double rel_rms(train::named_tensors<float> const& g, train::named_tensors<float> const& ref) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < g.size(); ++i)
    for (std::size_t j = 0; j < g.values[i].size(); ++j) {
      double const r = ref.values[i][j], e = static_cast<double>(g.values[i][j]) - r;
      num += e * e;
      den += r * r;
    }
  return den > 0 ? std::sqrt(num / den) : (num > 0 ? INFINITY : 0.0);
}

int run_train_step(k3::cli::args& args) {
  std::string const policy = args.choice("policy", {"keep", "recompute", "fp8", "offload", "mixed"});
  train::stack_config c;
  c.layers = args.integer_in("layers", 4, 1, 64);
  c.tokens = args.integer_in("tokens", 2048, 1, 1 << 20);
  c.seed = static_cast<std::uint64_t>(args.integer_in("seed", 0, 0, INT64_MAX));
  k3::cpu::threads<> backend(args.threads(0));
  auto const params = train::stack_parameters<float>(c);
  auto const in = train::stack_inputs<float>(c);
  train::step_policy const p = *train::parse_step_policy(policy);
  auto const r = train::train_step(backend, train::train_step_args<float>{&params, &in}, {c, p});
  double err = 0;
  if (p != train::step_policy::keep) err = rel_rms(r.gradients, train::train_step(backend, train::train_step_args<float>{&params, &in}, {c, train::step_policy::keep}).gradients);
  std::string const sum = checksum(r.gradients);
  if (args.has("out")) {
    std::filesystem::create_directories(args.value("out"));
    for (std::size_t i = 0; i < r.gradients.size(); ++i) {
      std::vector<k3::index_t> const& s = r.gradients.shapes[i];
      float const* d = r.gradients.data(i);
      std::string const& name = r.gradients.names[i];
      if (s.size() == 1) args.save(name, k3::tensor_view<float const, 1>(d, {s[0]}));
      else if (s.size() == 2) args.save(name, k3::tensor_view<float const, 2>(d, {s[0], s[1]}));
      else args.save(name, k3::tensor_view<float const, 3>(d, {s[0], s[1], s[2]}));
    }
  }
  if (args.flag("json")) {
    std::printf("{\"policy\": \"%s\", \"saved_bytes\": %zu, \"resident_peak_bytes\": %zu, \"host_bytes\": %zu, \"grad_checksum\": \"%s\", "
                "\"grad_rel_err_vs_keep\": %.17g}\n",
                policy.c_str(), r.stats.saved_bytes, r.stats.resident_peak_bytes, r.stats.host_peak_bytes, sum.c_str(), err);
  } else {
    std::printf("policy %s: %lld KDA layers + 1 MoE layer, %lld tokens, seed %llu\n", policy.c_str(), static_cast<long long>(c.layers),
                static_cast<long long>(c.tokens), static_cast<unsigned long long>(c.seed));
    std::printf("  saved_bytes          %14zu\n  resident_peak_bytes  %14zu\n  host_bytes           %14zu (peak of the host pool)\n",
                r.stats.saved_bytes, r.stats.resident_peak_bytes, r.stats.host_peak_bytes);
    std::printf("  grad_checksum        %s\n  grad_rel_err_vs_keep %.3e\n", sum.c_str(), err);
  }
  return 0;
}

k3::cli::registrar reg({"train-step", "one training step of a KDA + MoE stack with its saved tensors under one policy",
                        "Runs forward and backward of --layers KDA layers (projections, short conv + SiLU, l2norm, the\n"
                        "lower-bounded gate, beta, chunked KDA, output projection, residual) and one Stable LatentMoE\n"
                        "layer on --tokens random tokens (d = 256: 2 heads of 128; 16 experts, top 4, latent 128, expert\n"
                        "FFN 256), parameters and inputs seeded by --seed, with every tensor the backward needs saved\n"
                        "through k3::train::saved_tensor_store under --policy: keep; recompute (layer inputs kept, the rest\n"
                        "recomputed on demand); fp8 (1x128 E4M3 blocks for floating tensors); offload (host pool, the next\n"
                        "layer prefetched); mixed (K3's choice: elementwise results recomputed, the rest fp8 + offloaded).\n"
                        "Prints saved_bytes, resident_peak_bytes, host_bytes (the host pool's peak), grad_checksum (SHA-256\n"
                        "of every parameter gradient's float32 bytes, in parameter order) and grad_rel_err_vs_keep (relative\n"
                        "RMS of all gradients against keep's). --out DIR writes each gradient as DIR/<name>.npy.\n"
                        "Presets and roles: docs/training_memory.md.",
                        {{"policy", true, "keep|recompute|fp8|offload|mixed (default keep)"},
                         {"layers", true, "KDA layers before the MoE layer (default 4)"},
                         {"tokens", true, "tokens in the step (default 2048)"},
                         {"seed", true, "seed of the parameters and inputs (default 0)"},
                         {"threads", true, "worker threads (default: all)"},
                         {"json", false, "print one JSON object"},
                         {"out", true, "directory to write the gradients to as .npy files (created)"},
                         {"help", false, "show this help"}},
                        false, run_train_step});

}  // namespace
