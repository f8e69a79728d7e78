// k3 ledger — the per-GPU memory ledger of a K3-like training step (k3/train/ledger.hpp).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "cli.hpp"
#include "k3/train/ledger.hpp"
#include "png.hpp"

namespace {

namespace train = k3::train;

char const* const row_names[5] = {"weights", "grads", "optimizer", "activations", "comm"};

double row(train::gpu_bytes const& g, int i) {
  double const v[5] = {g.weights, g.grads, g.optimizer, g.activations, g.comm};
  return v[i];
}

std::string num(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", x);
  return buf;
}

std::string bytes_json(train::gpu_bytes const& g) {
  std::string s = "{";
  for (int i = 0; i < 5; ++i) s += std::string(i ? ", " : "") + "\"" + row_names[i] + "\": " + num(row(g, i));
  return s + ", \"total\": " + num(g.total()) + "}";
}

void print_json(train::ledger const& l) {
  auto const& p = l.params;
  auto const& a = l.activation_values_per_token;
  std::string s = "{\"params\": {\"routed_experts\": " + num(p.routed_experts) + ", \"kda\": " + num(p.kda) + ", \"mla\": " + num(p.mla) +
                  ", \"moe_non_expert\": " + num(p.moe_non_expert) + ", \"embedding\": " + num(p.embedding) + ", \"dense_ffn\": " + num(p.dense_ffn) +
                  ", \"non_expert\": " + num(p.non_expert) + ", \"total\": " + num(p.total) + "}";
  s += ", \"activation_values_per_token\": {\"kda_layer\": " + num(a.kda_layer) + ", \"mla_layer\": " + num(a.mla_layer) +
       ", \"moe_layer\": " + num(a.moe_layer) + ", \"model\": " + num(a.model) + "}";
  s += ", \"per_gpu_bytes\": {\"naive\": " + bytes_json(l.naive) + ", \"k3\": " + bytes_json(l.k3) + "}";
  s += ", \"toggles\": {";
  for (std::size_t i = 0; i < train::technique_names.size(); ++i)
    s += std::string(i ? ", " : "") + "\"" + std::string(train::technique_names[i]) + "\": " + (l.on.on[i] ? "true" : "false");
  s += "}}";
  std::printf("%s\n", s.c_str());
}

void print_table(train::ledger const& l, train::parallel_config const& p) {
  std::printf("per-GPU memory, pipeline rank 0 of P = %lld (V = %lld, R = %lld, N = %lld, S = %lld tokens), GB:\n", (long long)p.pp,
              (long long)p.vpp, (long long)p.ep, (long long)p.dp, (long long)p.tokens);
  std::printf("  %-12s %12s %12s\n", "row", "naive", "k3");
  for (int i = 0; i < 5; ++i) std::printf("  %-12s %12.1f %12.1f\n", row_names[i], row(l.naive, i) / 1e9, row(l.k3, i) / 1e9);
  std::printf("  %-12s %12.1f %12.1f\n", "total", l.naive.total() / 1e9, l.k3.total() / 1e9);
  std::printf("parameters: %.3gT total, %.3gT routed experts, %.3gB non-expert\n", l.params.total / 1e12, l.params.routed_experts / 1e12,
              l.params.non_expert / 1e9);
}

// Both columns as stacked bars by row, per pipeline rank, on one GB scale.
void plot(train::ledger const& l, std::string const& path) {
  k3::cli::rgb const colors[5] = {{68, 114, 196}, {237, 125, 49}, {165, 165, 165}, {255, 192, 0}, {112, 173, 71}};
  int const ranks = static_cast<int>(l.naive_by_rank.size());
  int const left = 90, bottom = 60, top = 70, bar = 22, gap = 8, group = 2 * bar + gap + 26;
  int const width = std::max(640, left + ranks * group + 40), height = 520;
  k3::cli::canvas c(width, height);
  double peak = 1;
  for (int r = 0; r < ranks; ++r) peak = std::max({peak, l.naive_by_rank[r].total(), l.k3_by_rank[r].total()});
  // A round GB step for the axis.
  double const gb = peak / 1e9;
  double step = std::pow(10.0, std::floor(std::log10(gb)));
  if (gb / step < 2) step /= 5;
  else if (gb / step < 5) step /= 2;
  double const axis = std::ceil(gb / step) * step;
  int const plot_h = height - top - bottom;
  auto y_of = [&](double bytes) { return height - bottom - static_cast<int>(std::lround(bytes / 1e9 / axis * plot_h)); };
  for (double v = 0; v <= axis + 1e-9; v += step) {
    int const y = y_of(v * 1e9);
    c.fill(left - 4, y, width - 20, y + 1, {220, 220, 220});
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", v);
    c.text(left - 10 - 8 * static_cast<int>(std::string(buf).size()), y - 5, buf);
  }
  c.text(10, 10, "k3 ledger: per-gpu memory (gb), naive (left) and k3 (right) per pipeline rank", 2);
  int lx = 10;
  for (int i = 0; i < 5; ++i) {
    c.fill(lx, 34, lx + 12, 46, colors[i]);
    lx = c.text(lx + 16, 35, row_names[i]) + 14;
  }
  for (int r = 0; r < ranks; ++r) {
    int const x0 = left + r * group + 10;
    for (int col = 0; col < 2; ++col) {
      train::gpu_bytes const& g = col == 0 ? l.naive_by_rank[r] : l.k3_by_rank[r];
      int const x = x0 + col * (bar + gap);
      double acc = 0;
      for (int i = 0; i < 5; ++i) {
        int const y1 = y_of(acc), y0 = y_of(acc + row(g, i));
        c.fill(x, y0, x + bar, y1, colors[i]);
        acc += row(g, i);
      }
    }
    c.text(x0 + 2, height - bottom + 8, "r" + std::to_string(r));
  }
  c.fill(left - 4, height - bottom, width - 20, height - bottom + 1, {0, 0, 0});
  c.write_png(path);
}

int run_ledger(k3::cli::args& args) {
  train::parallel_config p;
  std::int64_t const big = std::int64_t(1) << 20;
  p.pp = args.integer_in("pp", 8, 1, 4096);
  p.vpp = args.integer_in("vpp", 4, 1, 4096);
  p.ep = args.integer_in("ep", 32, 1, big);
  p.dp = args.integer_in("dp", 8, 1, big);
  p.tokens = args.integer_in("tokens", 8192, 1, std::int64_t(1) << 40);
  train::toggles t;
  try {
    t = train::toggles::parse(args.value("toggles", "all"));
  } catch (k3::error const& e) {
    std::string m = e.what();
    if (m.rfind("k3: ", 0) == 0) m = m.substr(4);
    throw k3::cli::usage_error("option '--" + m.substr(0, m.find(':')) + "'" + m.substr(m.find(':')));
  }
  train::ledger const l = train::ledger_of(train::model_config{}, p, t);
  if (args.flag("json"))
    print_json(l);
  else
    print_table(l, p);
  if (args.has("plot")) plot(l, args.value("plot"));
  return 0;
}

k3::cli::registrar reg({"ledger", "per-GPU memory ledger of a K3 training step: naive vs the K3 techniques",
                        "Counts, for K3's shapes (d = 7168; 69 KDA, 24 MLA, 92 MoE layers and a dense first layer; 896\n"
                        "experts of 3 x 3584 x 3072; vocabulary 163840), what one GPU holds: BF16 weights, FP32 gradients,\n"
                        "Muon's optimizer state, the activations saved for the backward and the communication buffers, on\n"
                        "pipeline rank 0 (the busiest), with every technique off (naive) and with --toggles on (k3).\n"
                        "Techniques: fp8_activations, offload, moe_backward_rewrite, pp_balance, zero2_cpu_grads, p2p_muon,\n"
                        "moonep_buffers. --json prints one object {params, activation_values_per_token, per_gpu_bytes\n"
                        "{naive, k3}, toggles}; --plot draws both columns per pipeline rank as stacked bars (PNG).\n"
                        "Formulas: docs/training_memory.md.",
                        {{"pp", true, "P, pipeline stages (default 8)"},
                         {"vpp", true, "V, virtual stages per rank (default 4; 1 = plain 1F1B)"},
                         {"ep", true, "R, expert parallel size (default 32)"},
                         {"dp", true, "N, weight replicas, the ZeRO shard count (default 8)"},
                         {"tokens", true, "S, tokens per micro-batch (default 8192)"},
                         {"toggles", true, "all|none|a,b,... techniques on in the k3 column (default all)"},
                         {"json", false, "print one JSON object"},
                         {"plot", true, "write the stacked-bar chart to FILE.png"},
                         {"help", false, "show this help"}},
                        false, run_ledger});

}  // namespace
