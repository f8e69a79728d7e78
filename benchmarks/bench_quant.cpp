// Block quantization throughput against same-run yardsticks (all threads):
//   * 1x128 E4M3 (DeepSeek activations), MXFP8 (E4M3, RCEIL) and MXFP4 (E2M1, FLOOR) of a
//     [16384, 7168] bfloat16 tensor, as bytes (in + out) per second next to the in-place
//     read-then-write pass over a 256 MiB buffer (inplace_pass_yardstick). Bar: 1x128 E4M3 >= 60%.
//   * The block-scaled FP8 GEMM (2048^3, 1x128 A tiles, 128x128 B blocks) next to the median of
//     Eigen float GEMMs (gemm_yardstick). Bar: >= 50%.
//   * The public calls use store_mode::automatic and the host's tuning (k3/quant/tuning.hpp),
//     which the header prints. Informational: the same 1x128 quantisation with the code stores
//     forced the other way (cached or non-temporal), to re-check on other machines which pays.
// Each figure is a median over 7 repetitions interleaved with its yardstick.
#include <cstdio>
#include <ctime>
#include <random>
#include <string>
#include <vector>

#include "common/bench.hpp"
#include "k3/quant.hpp"

namespace {
// Process CPU seconds (all threads) of f(): on a shared machine the wall-clock ratios depend on
// how much of the machine each run got; CPU time (which includes memory stalls) does not.
template <class F>
double cpu_seconds(F&& f) {
  std::clock_t c0 = std::clock();
  f();
  return double(std::clock() - c0) / CLOCKS_PER_SEC;
}
}  // namespace

int main(int argc, char** argv) {
  using namespace k3::bench;
  csv_init(argc, argv);  // --csv FILE
  using k3::index_t;
  print_header("bench_quant: block quantization and block-scaled FP8 GEMM");
  int const nt = hardware_threads();
  k3::cpu::threads<> be(nt);
  int const reps = 7;

  index_t const m = 16384, k = 7168;
  k3::bench::aligned_buffer<k3::bfloat16> x(static_cast<std::size_t>(m * k));
  be.for_each_task(m, [&](index_t i) {
    std::mt19937 rng(static_cast<std::uint32_t>(i));
    std::normal_distribution<float> nd;
    for (index_t j = 0; j < k; ++j) x[static_cast<std::size_t>(i * k + j)] = k3::bfloat16(nd(rng));
  });
  k3::bench::aligned_buffer<std::uint8_t> q8(static_cast<std::size_t>(m * k)), q4(static_cast<std::size_t>(m * k / 2));
  k3::bench::aligned_buffer<float> s128(static_cast<std::size_t>(m * (k / 128)));
  k3::bench::aligned_buffer<std::uint8_t> smx(static_cast<std::size_t>(m * (k / 32)));
  auto xv = k3::host_view(x.data(), m, k);
  double const in_bytes = double(m) * k * 2;
  double const b128 = in_bytes + double(m) * k + double(s128.size()) * 4;
  double const bmx8 = in_bytes + double(m) * k + double(smx.size());
  double const bmx4 = in_bytes + double(m) * k / 2 + double(smx.size());

  namespace si = k3::quant::simd_impl;
  k3::quant::tuning const tune = k3::quant::tuning::host();
  bool const streams = tune.stream(k3::quant::store_mode::automatic, static_cast<std::size_t>(m * k));
  k3::quant::store_mode const other_mode = streams ? k3::quant::store_mode::cached : k3::quant::store_mode::streaming;
  k3::cache_sizes const caches = k3::host_cache_sizes();
  std::printf("# caches: L1d %zu KiB, L2 %zu KiB, L3 %zu KiB\n", caches.l1d >> 10, caches.l2 >> 10, caches.l3 >> 10);
  std::printf("# row tuning (from the cache sizes): input prefetch %s, streaming code stores from %s; here: %s\n",
              tune.prefetch_distance > 0 ? ("on, " + std::to_string(tune.prefetch_distance) + " ahead").c_str() : "off",
              tune.stream_min_bytes == ~std::size_t{0} ? "never" : (std::to_string(tune.stream_min_bytes >> 20) + " MiB").c_str(),
              streams ? "streaming" : "cached");
  inplace_pass_yardstick pass(nt);
  std::vector<double> yp, y128, y128s, ymx8, ymx4, cp, c128;
  k3::const_view<k3::bfloat16, 2> const xc = xv;
  for (int r = 0; r < reps + 1; ++r) {  // the first round warms up (page faults) and is dropped
    double p = 0, t1 = 0;
    double const cpu_p = cpu_seconds([&] { p = pass.gbps(); });
    double const cpu_1 = cpu_seconds([&] {
      t1 = seconds([&] {
        k3::quant::fp8_quantize(be,
                                k3::quant::fp8_quantize_args<k3::bfloat16>{
                                    .x = xv, .q = k3::host_view(q8.data(), m, k), .scales = k3::host_view(s128.data(), m, k / 128)},
                                {.tile = k3::quant::tile_1x128});
      });
    });
    double const t1s = seconds([&] {
      k3::quant::simd_impl::fp8_quantize<decltype(be)::arch_type>(be, xc, k3::host_view(q8.data(), m, k), k3::host_view(s128.data(), m, k / 128),
                                                                  k3::quant::tile_1x128, k3::quant::scale_format::fp32, other_mode);
    });
    double t2 = seconds([&] {
      k3::quant::mx_quantize(
          be, k3::quant::mx_quantize_args<k3::bfloat16>{.x = xv, .q = k3::host_view(q8.data(), m, k), .scales = k3::host_view(smx.data(), m, k / 32)},
          {.element = k3::quant::mx_element::e4m3, .rule = k3::quant::mx_rule::rceil});
    });
    double t3 = seconds([&] {
      k3::quant::mx_quantize(
          be,
          k3::quant::mx_quantize_args<k3::bfloat16>{.x = xv, .q = k3::host_view(q4.data(), m, k / 2), .scales = k3::host_view(smx.data(), m, k / 32)},
          {.element = k3::quant::mx_element::e2m1, .rule = k3::quant::mx_rule::floor});
    });
    if (r == 0) continue;
    cp.push_back(double(pass.bytes()) * 2 / cpu_p * 1e-9);
    c128.push_back(b128 / cpu_1 * 1e-9);
    yp.push_back(p);
    y128.push_back(b128 / t1 * 1e-9);
    y128s.push_back(b128 / t1s * 1e-9);
    ymx8.push_back(bmx8 / t2 * 1e-9);
    ymx4.push_back(bmx4 / t3 * 1e-9);
  }
  double const pm = median(yp);
  std::printf("in-place pass yardstick (%zu MiB): median %.2f GB/s\n", pass.bytes() >> 20, pm);
  std::printf("1x128 E4M3 quantize [16384, 7168] bf16: median %.2f GB/s (in+out) = %.1f%% of the pass  [bar 60%%: %s]\n",
              median(y128), 100 * median(y128) / pm, median(y128) >= 0.6 * pm ? "PASS" : "FAIL");
  std::printf("  same, per CPU-second (robust to a shared machine): pass %.2f, 1x128 E4M3 %.2f GB/cpu-s = %.1f%%\n", median(cp),
              median(c128), 100 * median(c128) / median(cp));
  std::printf("  same, with the code stores forced %s: median %.2f GB/s = %.1f%% of the pass (informational)\n",
              streams ? "cached" : "streaming (non-temporal)", median(y128s), 100 * median(y128s) / pm);
  std::printf("MXFP8 (E4M3, RCEIL) quantize:           median %.2f GB/s (in+out) = %.1f%% of the pass\n", median(ymx8),
              100 * median(ymx8) / pm);
  std::printf("MXFP4 (E2M1, FLOOR) quantize:           median %.2f GB/s (in+out) = %.1f%% of the pass\n", median(ymx4),
              100 * median(ymx4) / pm);
  {
    std::string const sh = "m=16384;k=7168;in=bf16";
    emit({"quant", "fp8_quantize", "1x128_e4m3", "threads", sh, 0, b128 / (median(y128) * 1e9), median(y128), "GB/s", 0, "inplace_pass_256MiB", pm,
          "GB/s", median(y128) / pm, nt});
    emit({"quant", "mx_quantize", "mxfp8_e4m3_rceil", "threads", sh, 0, bmx8 / (median(ymx8) * 1e9), median(ymx8), "GB/s", 0, "inplace_pass_256MiB",
          pm, "GB/s", median(ymx8) / pm, nt});
    emit({"quant", "mx_quantize", "mxfp4_e2m1_floor", "threads", sh, 0, bmx4 / (median(ymx4) * 1e9), median(ymx4), "GB/s", 0, "inplace_pass_256MiB",
          pm, "GB/s", median(ymx4) / pm, nt});
  }
  x = {};
  q8 = {};
  q4 = {};

  // ---- block-scaled GEMM ----
  index_t const gm = 2048, gn = 2048, gk = 2048;
  k3::bench::aligned_buffer<float> a(static_cast<std::size_t>(gm * gk)), b(static_cast<std::size_t>(gn * gk)), c(static_cast<std::size_t>(gm * gn));
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (auto& v : a) v = nd(rng);
  for (auto& v : b) v = nd(rng);
  k3::bench::aligned_buffer<std::uint8_t> qa(a.size()), qb(b.size());
  k3::bench::aligned_buffer<float> sa(static_cast<std::size_t>(gm * (gk / 128))), sb(static_cast<std::size_t>((gn / 128) * (gk / 128)));
  k3::quant::fp8_quantize(
      be, k3::quant::fp8_quantize_args<float>{
              .x = k3::host_view(a.data(), gm, gk), .q = k3::host_view(qa.data(), gm, gk), .scales = k3::host_view(sa.data(), gm, gk / 128)});
  k3::quant::fp8_quantize(
      be,
      k3::quant::fp8_quantize_args<float>{
          .x = k3::host_view(b.data(), gn, gk), .q = k3::host_view(qb.data(), gn, gk), .scales = k3::host_view(sb.data(), gn / 128, gk / 128)},
      {.tile = k3::quant::tile_128x128});
  gemm_yardstick eig(nt);
  std::vector<double> ye, yg;
  for (int r = 0; r < reps + 1; ++r) {
    double e = eig.gflops();
    double t = seconds([&] {
      k3::quant::fp8_block_gemm(be, k3::quant::fp8_block_gemm_args<>{.a_q = k3::host_view(qa.data(), gm, gk),
                                                                     .a_scales = k3::host_view(sa.data(), gm, gk / 128),
                                                                     .b_q = k3::host_view(qb.data(), gn, gk),
                                                                     .b_scales = k3::host_view(sb.data(), gn / 128, gk / 128),
                                                                     .c = k3::host_view(c.data(), gm, gn)});
    });
    if (r == 0) continue;
    ye.push_back(e);
    yg.push_back(2.0 * gm * gn * gk / t * 1e-9);
  }
  do_not_optimize(c[0]);
  double const em = median(ye), gmed = median(yg);
  std::printf("Eigen float GEMM yardstick (1024^3 x %d threads): median %.1f GFLOP/s\n", nt, em);
  std::printf("FP8 block-scaled GEMM %lldx%lldx%lld: median %.1f GFLOP/s = %.1f%% of Eigen  [bar 50%%: %s]\n", (long long)gm,
              (long long)gn, (long long)gk, gmed, 100 * gmed / em, gmed >= 0.5 * em ? "PASS" : "FAIL");
  emit({"quant", "fp8_block_gemm", "1x128_a_128x128_b", "threads", "M=2048;N=2048;K=2048", 0, 2.0 * gm * gn * gk / (gmed * 1e9), gmed, "GFLOP/s", 0,
        "eigen_gemm_1024_" + std::to_string(nt) + "t", em, "GFLOP/s", gmed / em, nt});
  return 0;
}
