// DPLR benchmark: chunked forward rate, and the single-long-sequence paths on 2 threads.
// B=1, H=1, T=65536, K=V=128, float. Every time is a median of interleaved repetitions and
// every rate is also given as a ratio to the same-run single-thread Eigen GEMM yardstick.
//
// Figures:
//  - forward tokens/s, 1 thread (cpu::threads<>(1)), and its "effective GFLOP/s" using the
//    nominal count 8 K V + 4 C K + 6 C V flops per token (state products + intra matrices)
//  - value-split path on 2 threads: speedup over 1 thread (issue bar: >= 1.7x)
//  - segment-map path on 2 threads: measured speedup, and the speedup predicted from the
//    same-run single-thread times of the forward and of the map pass:
//        predicted = t_fwd / (max(t_fwd, t_map) / 2 + t_fwd / 2)
//    (thread 0 runs its half forward while thread 1 builds its half's map [M | N], then
//    thread 1 finishes its half). The map pass carries K + V state columns instead of V: the
//    extra work is the K x K block M (about 2 K^2 per token on top of the forward's ~2 K V
//    per state product), i.e. the "2 K^3 per chunk" of the map chain at C = K.
//  - backward, 1 thread vs value split on 2 threads (T = 16384 to bound the stored states)
//  - KDA's chunked forward (k3::kda::forward, chunk 64, gate_lower_bound -5: its dense-tile
//    path) on the same shape and thread counts, and the DPLR / KDA time ratio (the Kimi Linear
//    paper reports KDA about 2x faster than DPLR). KDA's threaded backend runs one task per
//    (sequence, head), so on this single sequence its 2-thread figure uses one core.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wuninitialized"  // GCC bug 105593 in AVX-512 intrinsics via Eigen
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sys/resource.h>
#include <vector>

#include "common/bench.hpp"
#include "k3/dplr.hpp"
#include "k3/kda.hpp"

namespace {

struct data {
  k3::index_t T, K, V;
  std::vector<float> q, k, v, a, b, gk, o, dO, dq, dk, dv, da, db, dg;
  std::vector<float> ht;
  std::vector<float> beta;  // KDA's per-token beta on the same tokens
  data(k3::index_t T_, k3::index_t K_, k3::index_t V_) : T(T_), K(K_), V(V_) {
    std::mt19937_64 rng(7);
    std::normal_distribution<float> n01;
    std::uniform_real_distribution<float> u01(0.2f, 1.0f);
    auto fill = [&](std::vector<float>& x, std::size_t n, float s) {
      x.resize(n);
      for (auto& e : x) e = s * n01(rng);
    };
    std::size_t nk = T * K, nv = T * V;
    fill(q, nk, 1.0f);
    fill(k, nk, 1.0f / std::sqrt(float(K)));
    fill(v, nv, 1.0f);
    fill(dO, nv, 1.0f);
    a.resize(nk), b.resize(nk), gk.resize(nk);
    for (k3::index_t t = 0; t < T; ++t) {
      float nrm = 0, lam = u01(rng);
      for (k3::index_t d = 0; d < K; ++d) nrm += (a[t * K + d] = n01(rng)) * a[t * K + d];
      nrm = std::sqrt(nrm);
      for (k3::index_t d = 0; d < K; ++d) {
        a[t * K + d] /= nrm;
        b[t * K + d] = -lam * a[t * K + d];
        gk[t * K + d] = -std::log1p(std::exp(-n01(rng))) / 16;  // log sigmoid / 16
      }
    }
    beta.resize(T);
    for (auto& x : beta) x = 1 / (1 + std::exp(-n01(rng)));
    o.resize(nv), ht.resize(K * V);
    for (auto* x : {&dq, &dk, &da, &db, &dg}) x->resize(nk);
    dv.resize(nv);
  }
  k3::const_view<float, 4> cv(std::vector<float> const& x, k3::index_t D, k3::index_t t = -1) const {
    return k3::host_view(x.data(), 1, t < 0 ? T : t, 1, D);
  }
  k3::tensor_view<float, 4> mv(std::vector<float>& x, k3::index_t D, k3::index_t t = -1) { return k3::host_view(x.data(), 1, t < 0 ? T : t, 1, D); }
  // The first t tokens (all when t < 0); outputs unset.
  k3::dplr::forward_args<float> in(k3::index_t t = -1) const { return {cv(q, K, t), cv(k, K, t), cv(v, V, t), cv(a, K, t), cv(b, K, t), cv(gk, K, t)}; }
  // KDA on the same tokens: k = a (unit rows, as the delta rule wants), g = gk (>= -5).
  k3::kda::forward_args<float> kda() {
    k3::kda::forward_args<float> x;
    x.q = cv(q, K);
    x.k = cv(a, K);
    x.v = cv(v, V);
    x.g = cv(gk, K);
    x.beta = k3::host_view(static_cast<float const*>(beta.data()), 1, T, 1);
    x.o = mv(o, V);
    x.ht = k3::host_view(ht.data(), 1, 1, K, V);
    return x;
  }
};

double cpu_seconds() {
  rusage r;
  getrusage(RUSAGE_SELF, &r);
  return r.ru_utime.tv_sec + r.ru_utime.tv_usec * 1e-6 + r.ru_stime.tv_sec + r.ru_stime.tv_usec * 1e-6;
}

// Wall seconds, and the process CPU seconds the call used (summed over threads): on a quiet
// machine cpu/wall ~= the thread count when the path keeps every core busy.
struct timing {
  std::vector<double> wall, cpu;
  template <class F>
  void add(F&& f) {
    double c0 = cpu_seconds();
    wall.push_back(k3::bench::seconds(f));
    cpu.push_back(cpu_seconds() - c0);
  }
  double w() const { return k3::bench::median(wall); }
  double c() const { return k3::bench::median(cpu); }
};

}  // namespace

int main(int argc, char** argv) {
  using namespace k3::bench;
  csv_init(argc, argv);  // --csv FILE (removed before [reps] is read)
  print_header("dplr: chunked DPLR, single long sequence (B=1, H=1, K=V=128, float)");
  int reps = argc > 1 ? std::atoi(argv[1]) : 5;
  k3::index_t const T = 65536, K = 128, V = 128, C = 64, Tb = 16384;
  data d(T, K, V);
  gemm_yardstick gemm(1, 512);
  k3::cpu::threads<> t1(1), t2(2);
  k3::dplr::options vs, sm;
  vs.chunk_size = sm.chunk_size = C;
  vs.long_sequence = k3::dplr::sequence_split::value_split;
  sm.long_sequence = k3::dplr::sequence_split::segment_maps;
  auto fwd = d.in();
  fwd.o = d.mv(d.o, V);
  fwd.ht = k3::host_view(d.ht.data(), 1, 1, K, V);
  std::vector<float> M(K * K), N(K * V);
  k3::dplr::maps_args<float> const maps{fwd.q, fwd.k, fwd.v, fwd.a, fwd.b, fwd.gk, k3::host_view(M.data(), 1, 1, K, K), k3::host_view(N.data(), 1, 1, K, V)};
  auto bwd = [&](auto const& bk) {
    auto const in = d.in(Tb);
    k3::dplr::backward_args<float> g{in.q, in.k, in.v, in.a, in.b, in.gk, {}, d.cv(d.dO, V, Tb)};
    g.dq = d.mv(d.dq, K, Tb), g.dk = d.mv(d.dk, K, Tb), g.dv = d.mv(d.dv, V, Tb), g.da = d.mv(d.da, K, Tb), g.db = d.mv(d.db, K, Tb), g.dgk = d.mv(d.dg, K, Tb);
    k3::dplr::backward(bk, g, vs);
  };
  std::vector<double> yg;
  timing f1, f2v, f2s, mp, b1, b2, kd1, kd2;
  k3::kda::options kopt;
  kopt.mode = k3::kda::algorithm::chunk;
  kopt.gate_lower_bound = -5.0;
  for (int r = 0; r < reps; ++r) {
    yg.push_back(gemm.gflops());
    f1.add([&] { k3::dplr::forward(t1, fwd, vs); });
    f2v.add([&] { k3::dplr::forward(t2, fwd, vs); });
    f2s.add([&] { k3::dplr::forward(t2, fwd, sm); });
    mp.add([&] { k3::dplr::segment_maps(k3::cpu::serial{}, maps, vs); });
    b1.add([&] { bwd(t1); });
    b2.add([&] { bwd(t2); });
    kd1.add([&] { k3::kda::forward(t1, d.kda(), kopt); });
    kd2.add([&] { k3::kda::forward(t2, d.kda(), kopt); });
  }
  double g = median(yg), tf = f1.w(), tv = f2v.w(), ts = f2s.w(), tm = mp.w(), tb1 = b1.w(), tb2 = b2.w();
  std::printf("cpu/wall (busy cores; 1 or 2 on a quiet machine): fwd1 %.2f, value split %.2f, segment maps %.2f, map pass %.2f, bwd1 %.2f, bwd2 %.2f\n",
              f1.c() / tf, f2v.c() / tv, f2s.c() / ts, mp.c() / tm, b1.c() / tb1, b2.c() / tb2);
  if (f1.c() / tf < 0.9) std::printf("WARNING: the single-thread run got %.0f%% of a core: the machine is busy, speedups are not meaningful\n", 100 * f1.c() / tf);
  double flops_tok = 8.0 * K * V + 4.0 * C * K + 6.0 * C * V;
  double eff = flops_tok * T / tf * 1e-9;
  std::printf("yardstick: eigen float GEMM 512^3, 1 thread: %.1f GFLOP/s\n", g);
  std::printf("forward 1 thread: %.3f s, %.0f tokens/s, effective %.1f GFLOP/s = %.2f x GEMM yardstick\n", tf, T / tf, eff, eff / g);
  std::printf("map pass [M|N] over the whole sequence, 1 thread: %.3f s = %.2f x forward (extra work of the map pass)\n", tm, tm / tf);
  double sv = tf / tv;
  std::printf("value split, 2 threads: %.3f s, speedup %.2fx  [issue bar >= 1.7x: %s]\n", tv, sv, sv >= 1.7 ? "PASS" : "FAIL");
  double pred = tf / (std::max(tf, tm) / 2 + tf / 2);
  std::printf("segment maps, 2 threads: %.3f s, speedup %.2fx (predicted %.2fx from the map/forward cost ratio)\n", ts, tf / ts, pred);
  // Contention-robust view: CPU seconds summed over threads. The pool blocks (does not spin),
  // so 2-thread CPU / 1-thread CPU is the work inflation of the parallel path; with both
  // phases (chunk-parallel intra work, column-split state pass) balanced, the quiet-machine
  // speedup is about 2 / inflation less the fan-out cost.
  std::printf("work inflation (CPU s, 2 threads / 1 thread): value split fwd %.2f (bound %.2fx), segment maps fwd %.2f (bound %.2fx), value split bwd %.2f (bound %.2fx)\n",
              f2v.c() / f1.c(), 2 * f1.c() / f2v.c(), f2s.c() / f1.c(), 2 * f1.c() / f2s.c(), b2.c() / b1.c(), 2 * b1.c() / b2.c());
  std::printf("backward (T=%lld) 1 thread: %.3f s; value split 2 threads: %.3f s, speedup %.2fx\n", (long long)Tb, tb1, tb2, tb1 / tb2);
  double tk1 = kd1.w(), tk2 = kd2.w();
  std::printf("KDA chunked forward (k3::kda::forward, same shape, chunk 64, gate_lower_bound -5): 1 thread %.3f s (%.0f tokens/s, %.2f x GEMM at DPLR's flop count), 2 threads %.3f s (one (sequence, head) task: one core)\n",
              tk1, T / tk1, flops_tok * T / tk1 * 1e-9 / g, tk2);
  std::printf("DPLR / KDA forward time: 1 thread %.2f, 2 threads %.2f (DPLR value split vs KDA)  [Kimi Linear paper: KDA ~2x faster, i.e. ~2]\n", tf / tk1, tv / tk2);
  {
    std::string const sh = "B=1;T=65536;H=1;K=128;V=128";
    emit({"dplr", "forward", "chunk", "threads(1)", sh, (long long)T, tf, eff, "GFLOP/s(nominal)", T / tf, "eigen_gemm_512_1t", g, "GFLOP/s", eff / g, 1});
    emit({"dplr", "forward", "value_split", "threads(2)", sh, (long long)T, tv, flops_tok * T / tv * 1e-9, "GFLOP/s(nominal)", T / tv,
          "k3 forward 1 thread (time)", tf, "s", tf / tv, 2});
    emit({"dplr", "forward", "segment_maps", "threads(2)", sh, (long long)T, ts, flops_tok * T / ts * 1e-9, "GFLOP/s(nominal)", T / ts,
          "k3 forward 1 thread (time)", tf, "s", tf / ts, 2});
    std::string const shb = "B=1;T=16384;H=1;K=128;V=128";
    emit({"dplr", "backward", "value_split", "threads(2)", shb, (long long)Tb, tb2, 0, "", Tb / tb2, "k3 backward 1 thread (time)", tb1, "s", tb1 / tb2, 2});
    emit({"dplr", "forward_vs_kda", "chunk", "threads(1)", sh, (long long)T, tf, T / tf, "tok/s", T / tf, "k3 kda forward 1 thread (time)", tk1, "s",
          tf / tk1, 1});
  }
  return 0;
}
