// KDA forward/backward/decode throughput on the CPU, as ratios against same-run yardsticks:
//   - chunked and serial forward in GFLOP/s (Kimi Linear's count, 6Td^2 + 3TCd + TC^2 per head,
//     d = 128, C = 64) over the median of >= 7 interleaved 1024^3 Eigen float GEMMs (all threads);
//   - chunked backward time over chunked forward time, two pairs: the backward with the
//     forward's saved states (forward_args::saved) over the training forward that fills them
//     (the bar's pair: what a training step runs), and the backward that recomputes the
//     states over the plain forward; plus the training forward's cost over the plain one;
//   - decode state bytes (read + write) per second over an in-place pass over the same state
//     pool (256 MiB, beyond the last-level cache).
// B = 1, H = 16, K = V = 128, float32, T from 4096 to 32768 (--quick: T = 4096 only).
//
// --sweep-T T1,T2,...: instead, forward (and the chunked backward, unless --no-backward)
// throughput for each form (chunk, recurrent) and backend (cpu::serial, cpu::simd, cpu::threads) at each T,
// as tokens/s and GFLOP/s (same count) over the median Eigen GEMM rate with the backend's
// thread count (1 for serial and simd), interleaved; --reps N (default 3).
// --csv FILE (or K3_BENCH_CSV=FILE): also append every figure as a CSV row (common/bench.hpp).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "common/bench.hpp"
#include "k3/kda.hpp"

using k3::index_t;

namespace {

using row_buffer = k3::bench::aligned_buffer<float>;

struct inputs {
  index_t T, H, K, V;
  row_buffer q, k, v, g, beta, o, d_o, dq, dk, dv, dg, db, ht, dh0;
  inputs(index_t T_, index_t H_, index_t K_, index_t V_) : T(T_), H(H_), K(K_), V(V_) {
    std::mt19937 rng(1);
    std::normal_distribution<float> nd;
    auto fill_normed = [&](row_buffer& x) {
      x.resize(std::size_t(T * H * K));
      for (index_t r = 0; r < T * H; ++r) {
        float s = 0;
        for (index_t i = 0; i < K; ++i) s += (x[std::size_t(r * K + i)] = nd(rng)) * x[std::size_t(r * K + i)];
        for (index_t i = 0; i < K; ++i) x[std::size_t(r * K + i)] /= std::sqrt(s);
      }
    };
    fill_normed(q);
    fill_normed(k);
    v.resize(std::size_t(T * H * V));
    for (auto& x : v) x = nd(rng);
    d_o = v;
    g.resize(std::size_t(T * H * K));
    for (auto& x : g) x = -5.0f / (1.0f + std::exp(-nd(rng)));  // fla's lower-bounded gate, lb = -5
    beta.resize(std::size_t(T * H));
    for (auto& x : beta) x = 1 / (1 + std::exp(-nd(rng)));
    o.resize(v.size());
    dq.resize(q.size());
    dk.resize(k.size());
    dv.resize(v.size());
    dg.resize(g.size());
    db.resize(beta.size());
    ht.resize(std::size_t(H * K * V));
    dh0.resize(ht.size());
  }
  k3::kda::forward_args<float> fwd() {
    k3::kda::forward_args<float> a;
    a.q = k3::host_view(q.data(), 1, T, H, K);
    a.k = k3::host_view(k.data(), 1, T, H, K);
    a.v = k3::host_view(v.data(), 1, T, H, V);
    a.g = k3::host_view(g.data(), 1, T, H, K);
    a.beta = k3::host_view(beta.data(), 1, T, H);
    a.o = k3::host_view(o.data(), 1, T, H, V);
    a.ht = k3::host_view(ht.data(), 1, H, K, V);
    return a;
  }
  k3::kda::backward_args<float> bwd() {
    k3::kda::backward_args<float> a;
    a.q = k3::host_view(q.data(), 1, T, H, K);
    a.k = k3::host_view(k.data(), 1, T, H, K);
    a.v = k3::host_view(v.data(), 1, T, H, V);
    a.g = k3::host_view(g.data(), 1, T, H, K);
    a.beta = k3::host_view(beta.data(), 1, T, H);
    a.d_o = k3::host_view(d_o.data(), 1, T, H, V);
    a.dq = k3::host_view(dq.data(), 1, T, H, K);
    a.dk = k3::host_view(dk.data(), 1, T, H, K);
    a.dv = k3::host_view(dv.data(), 1, T, H, V);
    a.dg = k3::host_view(dg.data(), 1, T, H, K);
    a.dbeta = k3::host_view(db.data(), 1, T, H);
    a.dh0 = k3::host_view(dh0.data(), 1, H, K, V);
    return a;
  }
};

char const* verdict(bool ok) { return ok ? "PASS" : "FAIL"; }

std::vector<index_t> parse_list(char const* s) {
  std::vector<index_t> v;
  for (char const* p = s; *p;) {
    char* e = nullptr;
    long long x = std::strtoll(p, &e, 10);
    if (e == p) break;
    v.push_back(static_cast<index_t>(x));
    p = *e == ',' ? e + 1 : e;
  }
  return v;
}

std::string shape_of(index_t T, index_t H, index_t d) {
  return "B=1;T=" + std::to_string(T) + ";H=" + std::to_string(H) + ";K=" + std::to_string(d) + ";V=" + std::to_string(d);
}

// The T sweep: every (form, backend) pair at each T, forward and backward, interleaved with
// the GEMM yardstick of the backend's thread count.
int run_sweep(std::vector<index_t> const& Ts, int reps, bool with_backward, bool recurrent_backward, int threads) {
  using namespace k3::bench;
  index_t const H = 16, d = 128, C = 64;
  k3::cpu::serial se;
  k3::cpu::simd<> si;
  k3::cpu::threads<> th(threads);
  gemm_yardstick g1(1), gN(threads);
  std::vector<double> y1, yN;
  y1.push_back(g1.gflops());
  yN.push_back(gN.gflops());
  char const* forms[2] = {"chunk", "recurrent"};
  char const* backends[3] = {"serial", "simd", "threads"};
  struct cell {
    std::vector<double> f, b;
  };
  std::vector<std::vector<cell>> cells(Ts.size(), std::vector<cell>(6));
  for (std::size_t ti = 0; ti < Ts.size(); ++ti) {
    index_t const T = Ts[ti];
    inputs in(T, H, d, d);
    auto fa = in.fwd();
    auto ba = in.bwd();
    auto run = [&](int bk, int form, bool bwd) {
      k3::kda::options opt;
      if (form == 0) {
        opt.mode = k3::kda::algorithm::chunk;
        opt.gate_lower_bound = -5.0;
      } else
        opt.mode = k3::kda::algorithm::recurrent;
      auto go = [&](auto const& be) {
        if (bwd)
          k3::kda::backward(be, ba, opt);
        else
          k3::kda::forward(be, fa, opt);
      };
      if (bk == 0)
        go(se);
      else if (bk == 1)
        go(si);
      else
        go(th);
    };
    for (int c = 0; c < 6; ++c) run(c % 3, c / 3, false);  // warm-up
    for (int r = 0; r < reps; ++r) {
      for (int c = 0; c < 6; ++c) {
        cells[ti][c].f.push_back(seconds([&] { run(c % 3, c / 3, false); }));
        if (with_backward && (c / 3 == 0 || recurrent_backward)) cells[ti][c].b.push_back(seconds([&] { run(c % 3, c / 3, true); }));
        if (c % 3 == 2)
          yN.push_back(gN.gflops());
        else
          y1.push_back(g1.gflops());
      }
    }
  }
  double const m1 = median(y1), mN = median(yN);
  std::printf("# T sweep: gemm yardsticks (median of interleaved 1024^3 Eigen float GEMMs): 1 thread %.1f GFLOP/s (%zu runs), %d threads %.1f GFLOP/s (%zu runs)\n",
              m1, y1.size(), threads, mN, yN.size());
  std::printf("# GFLOP/s: Kimi Linear's count 6Td^2 + 3TCd + TC^2 per head; ratio: over the GEMM with the backend's threads; medians of %d\n", reps);
  std::printf("%7s %10s %8s %10s %12s %9s %7s %10s %8s\n", "T", "form", "backend", "fwd ms", "fwd tok/s", "GFLOP/s", "ratio", "bwd ms",
              "bwd/fwd");
  for (std::size_t ti = 0; ti < Ts.size(); ++ti) {
    index_t const T = Ts[ti];
    double const flops = double(H) * (6.0 * T * d * d + 3.0 * T * C * d + double(T) * C * C);
    for (int c = 0; c < 6; ++c) {
      int const bk = c % 3, form = c / 3, nth = bk == 2 ? threads : 1;
      double const y = bk == 2 ? mN : m1;
      std::string const ys = bk == 2 ? "eigen_gemm_1024_" + std::to_string(threads) + "t" : std::string("eigen_gemm_1024_1t");
      double const tf = median(cells[ti][c].f), gf = flops / tf * 1e-9;
      // The recurrent backward (the reference path, 6-8x the chunked one) only on request.
      bool const has_b = with_backward && (form == 0 || recurrent_backward);
      double const tb = has_b ? median(cells[ti][c].b) : 0.0;
      std::printf("%7lld %10s %8s %10.2f %12.0f %9.1f %7.2f", static_cast<long long>(T), forms[form], backends[bk], tf * 1e3, T / tf, gf,
                  gf / y);
      if (has_b)
        std::printf(" %10.2f %8.2f\n", tb * 1e3, tb / tf);
      else
        std::printf("\n");
      emit({"kda", "forward", forms[form], backends[bk], shape_of(T, H, d), (long long)T, tf, gf, "GFLOP/s", T / tf, ys, y, "GFLOP/s", gf / y, nth});
      if (has_b)
        emit({"kda", "backward", forms[form], backends[bk], shape_of(T, H, d), (long long)T, tb, flops / tb * 1e-9, "GFLOP/s(fwd count)", T / tb,
              std::string("k3 forward (same form, backend)"), tf, "s", tb / tf, nth});
    }
  }
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  k3::bench::csv_init(argc, argv);
  bool quick = false, decode_only = false, with_backward = true, recurrent_backward = false;
  std::vector<index_t> sweep_T;
  int sweep_reps = 3;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0)
      quick = true;
    else if (std::strcmp(argv[i], "--decode-only") == 0)
      decode_only = true;
    else if (std::strcmp(argv[i], "--sweep-T") == 0 && i + 1 < argc)
      sweep_T = parse_list(argv[++i]);
    else if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc)
      sweep_reps = std::max(1, std::atoi(argv[++i]));
    else if (std::strcmp(argv[i], "--no-backward") == 0)
      with_backward = false;
    else if (std::strcmp(argv[i], "--recurrent-backward") == 0)
      recurrent_backward = true;
    else {
      std::fprintf(stderr, "usage: bench_kda [--quick] [--decode-only] [--sweep-T T1,T2,... [--reps N] [--no-backward] [--recurrent-backward]] [--csv FILE]\n");
      return 2;
    }
  }
  if (!sweep_T.empty()) {
    k3::bench::print_header("KDA T sweep (B=1, H=16, K=V=128, float32, chunk 64, gate lower bound -5 for the chunked form)");
    return run_sweep(sweep_T, sweep_reps, with_backward, recurrent_backward, k3::bench::hardware_threads());
  }
  k3::bench::print_header("KDA (B=1, H=16, K=V=128, float32, chunk 64)");
  int const threads = k3::bench::hardware_threads();
  k3::cpu::threads<> be(threads);
  k3::bench::gemm_yardstick gemm(threads);
  std::vector<double> gemm_rates;
  auto yard = [&] {
    if (!decode_only) gemm_rates.push_back(gemm.gflops());
  };
  yard();

  index_t const H = 16, d = 128, C = 64;
  std::vector<index_t> Ts = quick ? std::vector<index_t>{4096} : std::vector<index_t>{4096, 8192, 16384, 32768};
  if (decode_only) Ts.clear();
  struct row {
    index_t T;
    double chunk_s, serial_s, bwd_s, train_s, bwd_saved_s;
  };
  std::vector<row> rows;
  for (index_t T : Ts) {
    inputs in(T, H, d, d);
    int const reps = T <= 8192 ? 5 : 3;
    std::vector<double> tc, ts, tb, tt, tbs;
    k3::kda::options chunk_opt, serial_opt;
    chunk_opt.mode = k3::kda::algorithm::chunk;
    chunk_opt.gate_lower_bound = -5.0;
    serial_opt.mode = k3::kda::algorithm::recurrent;
    auto fa = in.fwd();
    auto ba = in.bwd();
    auto fs = fa;  // training forward: also fills the saved states
    auto bs = ba;  // backward reading them
    auto const sh = k3::kda::saved_shape(fa, chunk_opt);
    row_buffer saved(std::size_t(sh[0] * sh[1] * sh[2]));
    fs.saved = k3::host_view(saved.data(), sh[0], sh[1], sh[2]);
    bs.saved = fs.saved;
    k3::kda::forward(be, fa, chunk_opt);  // warm-up
    k3::kda::forward(be, fs, chunk_opt);
    for (int r = 0; r < reps; ++r) {
      tc.push_back(k3::bench::seconds([&] { k3::kda::forward(be, fa, chunk_opt); }));
      yard();
      ts.push_back(k3::bench::seconds([&] { k3::kda::forward(be, fa, serial_opt); }));
      yard();
      tb.push_back(k3::bench::seconds([&] { k3::kda::backward(be, ba, chunk_opt); }));
      yard();
      tt.push_back(k3::bench::seconds([&] { k3::kda::forward(be, fs, chunk_opt); }));
      tbs.push_back(k3::bench::seconds([&] { k3::kda::backward(be, bs, chunk_opt); }));
      yard();
    }
    rows.push_back({T, k3::bench::median(tc), k3::bench::median(ts), k3::bench::median(tb), k3::bench::median(tt), k3::bench::median(tbs)});
  }

  // Decode: one token for 256 sequences whose 1 MiB states (HV=16 x 128 x 128 fp32) sit in a
  // 256 MiB pool, slots shuffled.
  index_t const P = 256, N = 256;
  std::vector<float> pool(std::size_t(P * H * d * d), 0.01f);
  std::vector<float> dq_(std::size_t(N * H * d)), dk_(dq_.size()), dv_(dq_.size()), dg_(dq_.size(), -0.05f), db_(std::size_t(N * H), 0.5f),
      do_(dq_.size());
  {
    std::mt19937 rng(2);
    std::normal_distribution<float> nd;
    for (auto* x : {&dq_, &dk_, &dv_}) {
      for (auto& y : *x) y = nd(rng) * 0.09f;
    }
  }
  std::vector<std::int64_t> slots(static_cast<std::size_t>(N));
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), std::mt19937(3));
  k3::kda::decode_args<float> da;
  da.q = k3::host_view(dq_.data(), N, H, d);
  da.k = k3::host_view(dk_.data(), N, H, d);
  da.v = k3::host_view(dv_.data(), N, H, d);
  da.g = k3::host_view(dg_.data(), N, H, d);
  da.beta = k3::host_view(db_.data(), N, H);
  da.o = k3::host_view(do_.data(), N, H, d);
  da.state_pool = k3::host_view(pool.data(), P, H, d, d);
  da.slots64 = k3::host_view(slots.data(), N);
  double const pool_bytes = double(pool.size()) * sizeof(float);
  // The yardstick pass runs over the pool itself, as issue 3 asks ("a same-run in-place
  // read-then-write pass over the same pool"): on this VM two separate 256 MiB allocations can
  // stream at different rates.
  k3::bench::inplace_pass_yardstick pass(threads, pool.data(), pool.size());
  // Also per CPU-second (process CPU time, all threads): on a shared machine the wall-clock
  // ratio swings with other load, the CPU-time ratio much less.
  auto cpu_now = [] {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
  };
  std::vector<double> dec, pas, dec_cpu, pas_cpu;
  k3::kda::decode(be, da);
  for (int r = 0; r < (decode_only ? 15 : 7); ++r) {
    double c0 = cpu_now();
    double const sd = k3::bench::seconds([&] { k3::kda::decode(be, da); });
    double c1 = cpu_now();
    dec.push_back(2.0 * pool_bytes / sd * 1e-9);
    dec_cpu.push_back(2.0 * pool_bytes / (c1 - c0) * threads * 1e-9);
    pas.push_back(pass.gbps());
    double c2 = cpu_now();
    pas_cpu.push_back(2.0 * pool_bytes / (c2 - c1) * threads * 1e-9);
  }
  yard();
  while (!decode_only && gemm_rates.size() < 7) yard();

  double const gemm_med = k3::bench::median(gemm_rates);
  if (!decode_only) {
    std::printf("# gemm yardstick: median %.1f GFLOP/s over %zu interleaved 1024^3 Eigen float GEMMs (%d threads)\n", gemm_med,
                gemm_rates.size(), threads);
    std::printf("%7s %12s %8s %12s %8s %10s %10s %8s | %10s %8s %10s %8s\n", "T", "chunk GF/s", "ratio", "serial GF/s", "ratio", "fwd ms",
                "bwd ms", "bwd/fwd", "train ms", "train/fwd", "bwd-sv ms", "bwd-sv/train");
    std::printf("# bwd ms: backward recomputing the forward's states; train ms: forward that also saves them (forward_args::saved);\n"
                "# bwd-sv ms: backward reading them (backward_args::saved). The bar uses bwd-sv/train, the training pair.\n");
  }
  bool ok_chunk = true, ok_serial = true, ok_bwd = true;
  for (auto const& r : rows) {
    double const flops = double(H) * (6.0 * r.T * d * d + 3.0 * r.T * C * d + double(r.T) * C * C);
    double const gc = flops / r.chunk_s * 1e-9, gs = flops / r.serial_s * 1e-9;
    double const rc = gc / gemm_med, rs = gs / gemm_med, rb = r.bwd_s / r.chunk_s, rt = r.train_s / r.chunk_s;
    double const rbs = r.bwd_saved_s / r.train_s;
    ok_chunk &= rc >= 0.8;
    ok_serial &= rs >= 0.8;
    ok_bwd &= rbs <= 2.5;
    std::printf("%7lld %12.1f %8.2f %12.1f %8.2f %10.1f %10.1f %8.2f | %10.1f %8.2f %10.1f %8.2f\n", static_cast<long long>(r.T), gc, rc, gs,
                rs, r.chunk_s * 1e3, r.bwd_s * 1e3, rb, r.train_s * 1e3, rt, r.bwd_saved_s * 1e3, rbs);
    {
      using k3::bench::emit;
      std::string const sh = shape_of(r.T, H, d), ys = "eigen_gemm_1024_" + std::to_string(threads) + "t";
      long long const T = r.T;
      emit({"kda", "forward", "chunk", "threads", sh, T, r.chunk_s, gc, "GFLOP/s", T / r.chunk_s, ys, gemm_med, "GFLOP/s", rc, threads});
      emit({"kda", "forward", "recurrent", "threads", sh, T, r.serial_s, gs, "GFLOP/s", T / r.serial_s, ys, gemm_med, "GFLOP/s", rs, threads});
      emit({"kda", "backward_recompute", "chunk", "threads", sh, T, r.bwd_s, flops / r.bwd_s * 1e-9, "GFLOP/s(fwd count)", T / r.bwd_s,
            "k3 plain forward (chunk, threads)", r.chunk_s, "s", rb, threads});
      emit({"kda", "forward_train", "chunk", "threads", sh, T, r.train_s, flops / r.train_s * 1e-9, "GFLOP/s", T / r.train_s,
            "k3 plain forward (chunk, threads)", r.chunk_s, "s", rt, threads});
      emit({"kda", "backward_saved", "chunk", "threads", sh, T, r.bwd_saved_s, flops / r.bwd_saved_s * 1e-9, "GFLOP/s(fwd count)",
            T / r.bwd_saved_s, "k3 training forward (chunk, threads)", r.train_s, "s", rbs, threads});
    }
  }
  double const dm = k3::bench::median(dec), pm = k3::bench::median(pas);
  std::vector<double> per_run(dec.size());
  for (std::size_t r = 0; r < dec.size(); ++r) per_run[r] = dec[r] / pas[r];
  std::printf("decode: %.1f GB/s state traffic vs in-place pass over the same %.0f MiB pool %.1f GB/s: ratio %.2f "
              "(median of per-run ratios %.2f)\n",
              dm, pool_bytes / (1 << 20), pm, dm / pm, k3::bench::median(per_run));
  k3::bench::emit({"kda", "decode", "recurrent", "threads", "N=256;pool=256;H=16;K=128;V=128", 1, 2.0 * pool_bytes / (dm * 1e9), dm, "GB/s",
                   N / (2.0 * pool_bytes / (dm * 1e9)), "inplace_pass_same_pool", pm, "GB/s", dm / pm, threads});
  double const dc = k3::bench::median(dec_cpu), pc = k3::bench::median(pas_cpu);
  std::printf("decode per CPU-second x %d threads: %.1f vs in-place pass %.1f GB/s: ratio %.2f (a check for shared machines)\n", threads,
              dc, pc, dc / pc);
  if (!decode_only) {
    std::printf("bar chunked forward >= 0.80 x GEMM: %s\n", verdict(ok_chunk));
    std::printf("bar serial forward  >= 0.80 x GEMM: %s\n", verdict(ok_serial));
    std::printf("bar backward <= 2.5 x forward:      %s (backward with saved states / training forward)\n", verdict(ok_bwd));
  }
  std::printf("bar decode >= 0.85 x in-place pass: %s\n", verdict(dm / pm >= 0.85));
  return 0;
}
