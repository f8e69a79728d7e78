// Shared benchmark harness: every figure k3 reports is a ratio against a yardstick measured
// in the same run (Eigen GEMM rate, in-place memory pass), with medians over repetitions
// because the 2-core CI machines are noisy. Prints the SIMD ISA.
#pragma once
#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>
#include <xsimd/xsimd.hpp>

#include "k3/backend/cpu/thread_pool.hpp"
#include "k3/core/config.hpp"
#include "k3/core/host_memory.hpp"

namespace k3::bench {

// The ops' buffers, 64-byte aligned like k3::tensor's, the in-place pass's and Eigen's (the GEMM
// yardstick's): a large std::vector starts 16 bytes past a page, so every 64-byte row segment
// would straddle two cache lines, a handicap the yardsticks do not have.
template <class T>
using aligned_buffer = std::vector<T, xsimd::aligned_allocator<T, 64>>;

inline char const* isa() { return xsimd::default_arch::name(); }

inline double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <class F>
double seconds(F&& f) {
  double t0 = now();
  f();
  return now() - t0;
}

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Keeps the optimiser from discarding a result.
template <class T>
inline void do_not_optimize(T const& v) {
  asm volatile("" : : "g"(&v) : "memory");
}

// Aggregate GFLOP/s of `threads` independent n^3 float GEMMs through Eigen, run at once (one
// per thread): the machine's dense-math rate with all cores busy, as k3's kernels run them.
class gemm_yardstick {
 public:
  explicit gemm_yardstick(int threads, int n = 1024) : threads_(threads), n_(n), pool_(threads) {
    for (int t = 0; t < threads; ++t) {
      a_.emplace_back(Eigen::MatrixXf::Random(n, n));
      b_.emplace_back(Eigen::MatrixXf::Random(n, n));
      c_.emplace_back(Eigen::MatrixXf::Zero(n, n));
    }
  }
  double gflops() {
    double s = seconds([&] { pool_.run(threads_, [&](std::int64_t t) { c_[t].noalias() = a_[t] * b_[t]; }); });
    do_not_optimize(c_[0](0, 0));
    return 2.0 * double(n_) * n_ * n_ * threads_ / s * 1e-9;
  }

 private:
  int threads_, n_;
  cpu::thread_pool pool_;
  std::vector<Eigen::MatrixXf> a_, b_, c_;
};

// GB/s (bytes read + written) of an in-place read-then-write pass x[i] = x[i] * a + b over a
// buffer far larger than the last-level cache, all threads: the bandwidth a streaming
// elementwise op can reach on this machine.
class inplace_pass_yardstick {
 public:
  explicit inplace_pass_yardstick(int threads, std::size_t bytes = std::size_t(256) << 20)
      : threads_(threads), n_(bytes / sizeof(float)), pool_(threads), owned_(true) {
    x_ = detail::host_allocate<float>(n_);
    pool_.run(threads_, [&](std::int64_t t) {
      std::size_t lo = n_ * t / threads_, hi = n_ * (t + 1) / threads_;
      for (std::size_t i = lo; i < hi; ++i) x_[i] = 1.0f;
    });
  }
  // The pass over memory the caller owns (and whose values it may change: x -> 0.999 x + 0.001,
  // which keeps finite values finite). On this VM two equally sized allocations can stream at
  // different rates (host page placement), so an op that works in place on a buffer is best
  // compared with a pass over that same buffer.
  inplace_pass_yardstick(int threads, float* data, std::size_t n) : threads_(threads), n_(n), pool_(threads), x_(data) {}
  ~inplace_pass_yardstick() {
    if (owned_) detail::host_deallocate(x_, n_);
  }
  inplace_pass_yardstick(inplace_pass_yardstick const&) = delete;
  inplace_pass_yardstick& operator=(inplace_pass_yardstick const&) = delete;

  double gbps() {
    double s = seconds([&] {
      pool_.run(threads_, [&](std::int64_t t) {
        std::size_t lo = n_ * t / threads_, hi = n_ * (t + 1) / threads_;
        float* K3_RESTRICT p = x_;
        for (std::size_t i = lo; i < hi; ++i) p[i] = p[i] * 0.999f + 0.001f;
      });
    });
    do_not_optimize(x_[n_ / 2]);
    return 2.0 * double(n_) * sizeof(float) / s * 1e-9;
  }
  std::size_t bytes() const { return n_ * sizeof(float); }

 private:
  int threads_;
  std::size_t n_;
  cpu::thread_pool pool_;
  bool owned_ = false;
  float* x_ = nullptr;
};

inline int hardware_threads() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

inline void print_header(char const* what) {
  std::printf("# %s\n# simd isa: %s, hardware threads: %d\n", what, isa(), hardware_threads());
}

// ---- Machine-readable output ----------------------------------------------------------------
// Every benchmark takes `--csv FILE` (anywhere on its command line; it is removed from argv
// before the benchmark reads its own arguments) or the environment variable K3_BENCH_CSV=FILE,
// and then appends one CSV row per figure to FILE (the header once, when FILE is new or
// empty), next to its usual stdout. benchmarks/plot.py and benchmarks/torch_kda.py read and
// write the same columns:
//   benchmark,op,form,backend,shape,T,median_s,throughput,unit,tokens_per_s,
//   yardstick,yardstick_rate,yardstick_unit,ratio,isa,threads
// shape is "key=value;key=value" (B=1;T=4096;H=16;K=128;V=128); T repeats the token count
// (0 where it does not apply); ratio is the figure against its same-run yardstick as the
// benchmark prints it: a rate over the yardstick's rate, or, where the yardstick is another
// call's time (unit "s"), the printed time ratio (backward / forward, or a speedup).
struct record {
  std::string benchmark, op, form, backend, shape;
  long long T = 0;
  double median_s = 0, throughput = 0;
  std::string unit;
  double tokens_per_s = 0;
  std::string yardstick;
  double yardstick_rate = 0;
  std::string yardstick_unit;
  double ratio = 0;
  int threads = 1;
};

class csv_sink {
 public:
  static csv_sink& get() {
    static csv_sink s;
    return s;
  }
  // Takes `--csv FILE` out of argv (argc shrinks); falls back to $K3_BENCH_CSV.
  void init(int& argc, char** argv) {
    int w = 1;
    for (int i = 1; i < argc; ++i) {
      if (std::strcmp(argv[i], "--csv") == 0 && i + 1 < argc) {
        path_ = argv[++i];
      } else if (std::strncmp(argv[i], "--csv=", 6) == 0) {
        path_ = argv[i] + 6;
      } else {
        argv[w++] = argv[i];
      }
    }
    argc = w;
    argv[argc] = nullptr;
    if (path_.empty()) {
      if (char const* e = std::getenv("K3_BENCH_CSV")) path_ = e;
    }
  }
  bool enabled() const { return !path_.empty(); }
  void write(record const& r) {
    if (!enabled()) return;
    std::FILE* f = std::fopen(path_.c_str(), "a+");
    if (!f) {
      std::fprintf(stderr, "cannot open %s for --csv\n", path_.c_str());
      return;
    }
    std::fseek(f, 0, SEEK_END);
    auto c = [](std::string x) {  // a field never holds a comma
      for (char& ch : x)
        if (ch == ',') ch = ';';
      return x;
    };
    if (std::ftell(f) == 0)
      std::fputs("benchmark,op,form,backend,shape,T,median_s,throughput,unit,tokens_per_s,yardstick,yardstick_rate,yardstick_unit,ratio,isa,threads\n", f);
    std::fprintf(f, "%s,%s,%s,%s,%s,%lld,%.6g,%.6g,%s,%.6g,%s,%.6g,%s,%.6g,%s,%d\n", c(r.benchmark).c_str(), c(r.op).c_str(), c(r.form).c_str(),
                 c(r.backend).c_str(), c(r.shape).c_str(), r.T, r.median_s, r.throughput, c(r.unit).c_str(), r.tokens_per_s,
                 c(r.yardstick).c_str(), r.yardstick_rate, c(r.yardstick_unit).c_str(), r.ratio, isa(), r.threads);
    std::fclose(f);
  }

 private:
  std::string path_;
};

inline void csv_init(int& argc, char** argv) { csv_sink::get().init(argc, argv); }
inline void emit(record const& r) { csv_sink::get().write(r); }

}  // namespace k3::bench
