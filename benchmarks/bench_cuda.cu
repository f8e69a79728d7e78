// bench_cuda — the GPU benchmark table of tests/gpu/run.sh: each CUDA kernel at K3-like shapes,
// its time (median of the timed runs, CUDA events), the bytes it must move against a same-run
// device-to-device copy (the yardstick), and for KDA the recurrence FLOP rate.
//
//   ./build/benchmarks/bench_cuda [--quick]
//
// Byte counts are what each op has to read and write at least (inputs and outputs once), so
// "of copy" is the fraction of the copy's bandwidth the op reaches. KDA counts 6 K V FLOP per
// token and value head (the recurrence: decay and predict, update, output; 2 FLOP per
// multiply-add), whatever form the kernel evaluates.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "k3/attnres/cuda.cuh"
#include "k3/kda/cuda/kda.cuh"
#include "k3/moe/cuda.cuh"
#include "k3/quant/cuda.cuh"

K3_KDA_CUDA_INSTANTIATE(k3::bfloat16)

namespace {

using k3::bfloat16;
using index_t = std::int64_t;

struct device_buffer {
  void* p = nullptr;
  explicit device_buffer(std::size_t bytes, int fill = 0) {
    K3_CUDA_CHECK(cudaMalloc(&p, bytes));
    K3_CUDA_CHECK(cudaMemset(p, fill, bytes));
  }
  device_buffer(device_buffer const&) = delete;
  ~device_buffer() { (void)cudaFree(p); }
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

// Random values in [lo, hi) as T on the device.
template <class T>
void fill(device_buffer& b, std::size_t n, float lo, float hi, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<T> h(n);
  for (auto& x : h) x = T(u(rng));
  K3_CUDA_CHECK(cudaMemcpy(b.p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
}

double median_ms(std::function<void()> const& run, int reps) {
  cudaEvent_t a, b;
  K3_CUDA_CHECK(cudaEventCreate(&a));
  K3_CUDA_CHECK(cudaEventCreate(&b));
  run();  // warm-up
  K3_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    K3_CUDA_CHECK(cudaEventRecord(a));
    run();
    K3_CUDA_CHECK(cudaEventRecord(b));
    K3_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    K3_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  K3_CUDA_CHECK(cudaEventDestroy(a));
  K3_CUDA_CHECK(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

double copy_gbs = 0;  // the yardstick: bytes read + written per second by cudaMemcpy D2D

void row(char const* op, char const* shape, double ms, double bytes, double flop) {
  double const gbs = bytes / (ms * 1e-3) / 1e9;
  std::printf("| %-26s | %-30s | %9.3f | %8.0f | %6.1f%% |", op, shape, ms, gbs, 100.0 * gbs / copy_gbs);
  if (flop > 0)
    std::printf(" %8.1f |\n", flop / (ms * 1e-3) / 1e12);
  else
    std::printf("        - |\n");
  std::fflush(stdout);
}

void kda_forward(index_t T, index_t H, int reps) {
  index_t const K = 128, V = 128, N = T * H;
  device_buffer q(N * K * 2), k(N * K * 2), v(N * V * 2), g(N * K * 2), beta(N * 2), o(N * V * 2), ht(H * K * V * 4);
  fill<bfloat16>(q, N * K, -0.09f, 0.09f, 1);
  fill<bfloat16>(k, N * K, -0.09f, 0.09f, 2);
  fill<bfloat16>(v, N * V, -1.f, 1.f, 3);
  fill<bfloat16>(g, N * K, -0.3f, -0.001f, 4);
  fill<bfloat16>(beta, N, 0.1f, 0.9f, 5);
  k3::kda::cuda::fwd_args<bfloat16> a;
  a.q = q.as<bfloat16>(), a.k = k.as<bfloat16>(), a.v = v.as<bfloat16>(), a.g = g.as<bfloat16>(), a.beta = beta.as<bfloat16>();
  a.o = o.as<bfloat16>(), a.ht = ht.as<float>();
  a.B = 1, a.T = T, a.H = H, a.HV = H, a.K = K, a.V = V;
  double const ms = median_ms([&] { k3::kda::cuda::chunk_fwd(a, nullptr); }, reps);
  std::string const shape = "T " + std::to_string(T) + ", H " + std::to_string(H) + ", K = V 128";
  row("kda chunk_fwd (bf16)", shape.c_str(), ms, double(N) * (3 * K + V + 1 + V) * 2 + double(H * K * V) * 4, 6.0 * N * K * V);
  device_buffer dO(N * V * 2), dq(N * K * 4), dk(N * K * 4), dv(N * V * 4), dg(N * K * 4), db(N * 4);
  fill<bfloat16>(dO, N * V, -1.f, 1.f, 6);
  k3::kda::cuda::bwd_args<bfloat16> b;
  b.q = a.q, b.k = a.k, b.v = a.v, b.g = a.g, b.beta = a.beta, b.do_ = dO.as<bfloat16>();
  b.dq = dq.as<float>(), b.dk = dk.as<float>(), b.dv = dv.as<float>(), b.dg = dg.as<float>(), b.dbeta = db.as<float>();
  b.B = 1, b.T = T, b.H = H, b.HV = H, b.K = K, b.V = V;
  double const bms = median_ms([&] { k3::kda::cuda::chunk_bwd(b, nullptr); }, 1);
  row("kda chunk_bwd (bf16)", shape.c_str(), bms, double(N) * (3 * K + 2 * V + 1) * 2 + double(N) * (3 * K + V + 1) * 4, 12.0 * N * K * V);
}

void kda_decode(int reps) {
  index_t const S = 512, H = 32, K = 128, V = 128;
  device_buffer q(S * H * K * 2), k(S * H * K * 2), v(S * H * V * 2), g(S * H * K * 2), beta(S * H * 2), o(S * H * V * 2),
      pool(S * H * K * V * 4);
  fill<bfloat16>(q, S * H * K, -0.09f, 0.09f, 1);
  fill<bfloat16>(k, S * H * K, -0.09f, 0.09f, 2);
  fill<bfloat16>(v, S * H * V, -1.f, 1.f, 3);
  fill<bfloat16>(g, S * H * K, -0.3f, -0.001f, 4);
  fill<bfloat16>(beta, S * H, 0.1f, 0.9f, 5);
  k3::kda::cuda::decode_args<bfloat16> a;
  a.q = q.as<bfloat16>(), a.k = k.as<bfloat16>(), a.v = v.as<bfloat16>(), a.g = g.as<bfloat16>(), a.beta = beta.as<bfloat16>();
  a.o = o.as<bfloat16>(), a.state = pool.as<float>();
  a.N = S, a.P = S, a.H = H, a.HV = H, a.K = K, a.V = V;
  double const ms = median_ms([&] { k3::kda::cuda::decode(a, nullptr); }, reps);
  row("kda decode (bf16, fp32 pool)", "512 seqs, H 32, K = V 128", ms, double(S * H) * K * V * 8, 6.0 * S * H * K * V);
}

void kda_l2norm(int reps) {
  index_t const rows = 8192 * 96, D = 128;
  device_buffer x(rows * D * 2), y(rows * D * 2);
  fill<bfloat16>(x, rows * D, -1.f, 1.f, 7);
  double const ms = median_ms([&] { k3::kda::cuda::l2norm_fwd(x.as<bfloat16>(), y.as<bfloat16>(), rows, D, nullptr); }, reps);
  row("kda l2norm_fwd (bf16)", "786432 x 128", ms, double(rows) * D * 4, 0);
}

void route(int reps) {
  index_t const m = 16384, n = 896, k = 16, bins = 256;
  device_buffer scores(m * n * 4), bias(n * 4), idx(m * k * 4), w(m * k * 4), hist(n * bins * 8);
  fill<float>(scores, m * n, 0.f, 1.f, 8);
  k3::moe::cuda::route_args a;
  a.scores = scores.as<float>(), a.bias = bias.as<float>(), a.m = m, a.n = n, a.k = k;
  a.indices = idx.as<std::int32_t>(), a.weights = w.as<float>();
  a.hist = hist.as<unsigned long long>(), a.bins = bins, a.hist_lo = -1.f, a.hist_inv_width = 128.f;
  double const ms = median_ms([&] { k3::moe::cuda::route_launch<float>(a, nullptr); }, reps);
  row("moe route + histogram", "16384 tokens, 896 experts, k 16", ms, double(m) * n * 4 + double(m) * k * 8, 0);
}

void quant_fp8(int reps) {
  index_t const m = 8192, n = 7168;
  device_buffer x(m * n * 2), q(m * n), s(m * (n / 128) * 4);
  fill<bfloat16>(x, m * n, -3.f, 3.f, 9);
  k3::tensor_view<bfloat16 const, 2, k3::cuda_device_space> xv(x.as<bfloat16>(), {m, n});
  k3::tensor_view<std::uint8_t, 2, k3::cuda_device_space> qv(q.as<std::uint8_t>(), {m, n});
  k3::tensor_view<float, 2, k3::cuda_device_space> sv(s.as<float>(), {m, n / 128});
  double const ms =
      median_ms([&] { k3::quant::cuda::fp8_quantize<bfloat16>(xv, qv, sv, k3::quant::tile{1, 128}, k3::quant::scale_format::fp32, nullptr); }, reps);
  row("quant fp8 1x128 (bf16 in)", "8192 x 7168", ms, double(m) * n * 3 + double(m) * (n / 128) * 4, 0);
}

void attnres_mix(int reps) {
  index_t const T = 8192, d = 7168, n = 8;
  device_buffer bank(n * T * d * 2), partial(T * d * 2), u(d * 4), h(T * d * 2);
  fill<bfloat16>(bank, n * T * d, -1.f, 1.f, 10);
  fill<bfloat16>(partial, T * d, -1.f, 1.f, 11);
  fill<float>(u, d, -0.1f, 0.1f, 12);
  double const ms = median_ms(
      [&] { k3::cuda::attnres::mix_forward(bank.as<bfloat16>(), n, partial.as<bfloat16>(), T, d, u.as<float>(), 1e-6f, h.as<bfloat16>(), nullptr); },
      reps);
  row("attnres mix_forward (bf16)", "8 sources + partial, T 8192, d 7168", ms, double(n + 2) * T * d * 2, 0);
}

}  // namespace

int main(int argc, char** argv) {
  bool const quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  int const reps = quick ? 3 : 7;
  cudaDeviceProp prop{};
  K3_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, sm_%d%d, %d SMs, %.0f GiB\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount,
              double(prop.totalGlobalMem) / (1ull << 30));
  {
    std::size_t const bytes = std::size_t(2) << 30;
    device_buffer a(bytes), b(bytes);
    double const ms = median_ms([&] { K3_CUDA_CHECK(cudaMemcpy(b.p, a.p, bytes, cudaMemcpyDeviceToDevice)); }, reps);
    copy_gbs = 2.0 * double(bytes) / (ms * 1e-3) / 1e9;
    std::printf("yardstick: device-to-device copy of 2 GiB moves %.0f GB/s (read + write)\n\n", copy_gbs);
  }
  std::printf("| %-26s | %-30s | %9s | %8s | %7s | %8s |\n", "op", "shape", "ms", "GB/s", "of copy", "TFLOP/s");
  std::printf("| %s | %s | %s | %s | %s | %s |\n", std::string(26, '-').c_str(), std::string(30, '-').c_str(), std::string(9, '-').c_str(),
              std::string(8, '-').c_str(), std::string(7, '-').c_str(), std::string(8, '-').c_str());
  kda_forward(8192, 96, reps);
  kda_forward(32768, 16, reps);
  kda_decode(reps);
  kda_l2norm(reps);
  route(reps);
  quant_fp8(reps);
  attnres_mix(reps);
  return 0;
}
