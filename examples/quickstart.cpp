// Quickstart: one K3-shaped KDA layer core on built-in defaults (B=1, T=2048, H=16 heads,
// K=V=128, float32), the way a model runs it:
//   1. pre-processing: short causal conv (kernel 4) + SiLU on the q/k/v projections, L2 norm of
//      q and k, the lower-bounded gate g = -5 sigmoid(exp(A_log) (x + dt_bias)), beta = sigmoid;
//   2. the chunked forward (dense diagonal tiles, licensed by the gate's lower bound);
//   3. a check against the serial recurrence (relative RMS) and the throughput of both.
// Exit status 0 when the chunked and serial forms agree.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "k3/kda.hpp"
#include "k3/kda/preprocess.hpp"
#include "k3/version.hpp"

int main() {
  using k3::host_view;
  using k3::index_t;
  index_t const B = 1, T = 2048, H = 16, K = 128, V = 128, W = 4;
  double const lower_bound = -5.0;
  std::printf("k3 %s quickstart (simd isa: %s)\n", k3::version_string, k3::simd::isa_name<xsimd::default_arch>());
  std::printf("KDA layer: B=%lld T=%lld H=%lld K=V=%lld, float32, gate lower bound %.0f\n", (long long)B, (long long)T,
              (long long)H, (long long)K, lower_bound);

  // Stand-ins for the layer's input projections (what x W_q, x W_k, ... would give).
  std::mt19937 rng(0);
  std::normal_distribution<float> nd;
  auto randn = [&](std::size_t n, float s) {
    std::vector<float> x(n);
    for (auto& e : x) e = s * nd(rng);
    return x;
  };
  std::size_t const nqk = std::size_t(B * T * H * K), nv = std::size_t(B * T * H * V);
  std::vector<float> xq = randn(nqk, 1), xk = randn(nqk, 1), xv = randn(nv, 1);
  std::vector<float> wq = randn(std::size_t(H * K * W), 0.5f), wk = randn(std::size_t(H * K * W), 0.5f),
                     wv = randn(std::size_t(H * V * W), 0.5f);
  std::vector<float> xg = randn(nqk, 1), xb = randn(std::size_t(B * T * H), 1);
  std::vector<float> A_log = randn(std::size_t(H), 0.5f), dt_bias = randn(std::size_t(H * K), 0.5f);

  k3::cpu::threads<> backend;  // one thread per hardware thread
  // The outputs are allocated (and their pages touched) outside the timed region: the figures
  // below are the ops' own.
  std::vector<float> qc(nqk), kc(nqk), q(nqk), k(nqk), v(nv), g(nqk), beta(std::size_t(B * T * H));
  std::vector<float> o_chunk(nv), o_serial(nv), ht_chunk(std::size_t(B * H * K * V)), ht_serial(ht_chunk.size());
  auto t0 = std::chrono::steady_clock::now();

  // 1. pre-processing
  using conv_args = k3::kda::short_conv_args<float>;
  k3::kda::short_conv(backend, conv_args{.x = host_view(xq.data(), B, T, H * K), .weight = host_view(wq.data(), H * K, W), .y = host_view(qc.data(), B, T, H * K)});
  k3::kda::short_conv(backend, conv_args{.x = host_view(xk.data(), B, T, H * K), .weight = host_view(wk.data(), H * K, W), .y = host_view(kc.data(), B, T, H * K)});
  k3::kda::short_conv(backend, conv_args{.x = host_view(xv.data(), B, T, H * V), .weight = host_view(wv.data(), H * V, W), .y = host_view(v.data(), B, T, H * V)});
  k3::kda::l2norm(backend, k3::kda::l2norm_args<float>{.x = host_view(qc.data(), B, T, H, K), .y = host_view(q.data(), B, T, H, K)});
  k3::kda::l2norm(backend, k3::kda::l2norm_args<float>{.x = host_view(kc.data(), B, T, H, K), .y = host_view(k.data(), B, T, H, K)});
  k3::kda::gate_lower_bound(backend,
                            k3::kda::gate_args<float>{.x = host_view(xg.data(), B, T, H, K), .A_log = host_view(A_log.data(), H),
                                                      .dt_bias = host_view(dt_bias.data(), H, K), .g = host_view(g.data(), B, T, H, K)},
                            {.lower_bound = lower_bound});
  k3::kda::beta_sigmoid(backend, k3::kda::beta_sigmoid_args<float>{.x = host_view(xb.data(), B, T, H), .beta = host_view(beta.data(), B, T, H)});
  auto t1 = std::chrono::steady_clock::now();

  // 2. chunked forward, then 3. the serial recurrence on the same inputs
  auto args = [&](std::vector<float>& o, std::vector<float>& ht) {
    k3::kda::forward_args<float> a;
    a.q = host_view(q.data(), B, T, H, K);
    a.k = host_view(k.data(), B, T, H, K);
    a.v = host_view(v.data(), B, T, H, V);
    a.g = host_view(g.data(), B, T, H, K);
    a.beta = host_view(beta.data(), B, T, H);
    a.o = host_view(o.data(), B, T, H, V);
    a.ht = host_view(ht.data(), B, H, K, V);
    return a;
  };
  // The default form, algorithm::automatic, runs the recurrence for a forward alone on the CPU
  // (the faster form there) and the chunked form for training; both are run here by name.
  k3::kda::options opt;  // scale K^-1/2
  opt.mode = k3::kda::algorithm::chunk;
  opt.gate_lower_bound = lower_bound;
  k3::kda::forward(backend, args(o_chunk, ht_chunk), opt);
  auto t2 = std::chrono::steady_clock::now();
  opt.mode = k3::kda::algorithm::recurrent;
  k3::kda::forward(backend, args(o_serial, ht_serial), opt);
  auto t3 = std::chrono::steady_clock::now();

  auto rel_rms = [](std::vector<float> const& ref, std::vector<float> const& x) {
    double num = 0, den = 0;
    for (std::size_t i = 0; i < ref.size(); ++i) {
      num += double(ref[i] - x[i]) * double(ref[i] - x[i]);
      den += double(ref[i]) * double(ref[i]);
    }
    return std::sqrt(num / den);
  };
  auto secs = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
  double const sp = secs(t0, t1), sc = secs(t1, t2), ss = secs(t2, t3);
  double const flops = double(H) * (6.0 * T * K * K + 3.0 * T * 64 * K + double(T) * 64 * 64);  // Kimi Linear's count
  double const err_o = rel_rms(o_serial, o_chunk), err_h = rel_rms(ht_serial, ht_chunk);
  // Bytes the pre-processing reads and writes: three convs and two norms (x in, y out), the gate
  // (x in, g out), beta (small).
  double const pp_bytes = 4.0 * (2.0 * (2 * nqk + nv) + 2.0 * 2 * nqk + 2.0 * nqk + 2.0 * double(B * T * H));
  // The yardstick: an in-place pass (read and write every element) over as many bytes, on the
  // same threads; the pre-processing is memory-bound, so this is the speed it can approach.
  std::vector<float> pass(static_cast<std::size_t>(pp_bytes / 8.0));
  index_t const pass_blocks = 256, pass_n = static_cast<index_t>(pass.size());
  auto in_place = [&] {
    backend.for_each(0, pass_blocks, [&](index_t blk) {
      for (index_t i = pass_n * blk / pass_blocks; i < pass_n * (blk + 1) / pass_blocks; ++i)
        pass[std::size_t(i)] = pass[std::size_t(i)] * 0.5f + 1.0f;
    });
  };
  in_place();  // first touch
  auto p0 = std::chrono::steady_clock::now();
  in_place();
  double const spass = secs(p0, std::chrono::steady_clock::now());
  std::printf("pre-processing (conv+SiLU, L2 norm, gate, beta): %.1f ms, %.1f GB/s read + written, "
              "%.2f x an in-place pass over as many bytes (%.1f GB/s)\n",
              sp * 1e3, pp_bytes / sp * 1e-9, spass / sp, pp_bytes / spass * 1e-9);
  std::printf("chunked vs serial: rel RMS o %.2e, final state %.2e\n", err_o, err_h);
  std::printf("chunked forward: %.1f ms, %.0f tokens/s, %.1f GFLOP/s (%d threads)\n", sc * 1e3, double(B * T) / sc,
              flops / sc * 1e-9, backend.concurrency());
  std::printf("serial  forward: %.1f ms, %.0f tokens/s, %.1f GFLOP/s\n", ss * 1e3, double(B * T) / ss, flops / ss * 1e-9);
  bool const ok = err_o < 1e-4 && err_h < 1e-4;
  std::printf("%s\n", ok ? "OK: chunked and serial forms agree" : "MISMATCH between chunked and serial forms");
  return ok ? 0 : 1;
}
