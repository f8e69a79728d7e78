// CUDA block quantizers, dequantizers and GEMM against the CPU reference (k3::quant::reference):
// identical bytes for every quantizer and identical bits for the GEMM. Exits 77 without a GPU.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "support/error_of.hpp"
#include "k3/quant/cuda.cuh"
#include "k3/quant/reference.hpp"

using namespace k3;
using namespace k3::quant;
namespace qc = k3::quant::cuda;

namespace {

template <class T>
struct dbuf {
  T* p = nullptr;
  std::size_t n = 0;
  explicit dbuf(std::size_t n_) : n(n_) { K3_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p), (n ? n : 1) * sizeof(T))); }
  dbuf(std::vector<T> const& h) : dbuf(h.size()) { K3_CUDA_CHECK(cudaMemcpy(p, h.data(), n * sizeof(T), cudaMemcpyHostToDevice)); }
  ~dbuf() { cudaFree(p); }
  std::vector<T> get() const {
    std::vector<T> h(n);
    K3_CUDA_CHECK(cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
    return h;
  }
  template <class U = T>
  qc::dview<U, 2> v(index_t r, index_t c) const {
    return qc::dview<U, 2>(p, {r, c});
  }
};

std::vector<float> random_matrix(index_t m, index_t k, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<float> ud(-8, 8);
  std::vector<float> x(static_cast<std::size_t>(m * k));
  for (index_t i = 0; i < m; ++i) {
    float sc = std::exp2(ud(rng));
    for (index_t j = 0; j < k; ++j) x[i * k + j] = (rng() % 29 == 0) ? 0.0f : nd(rng) * sc;
  }
  if (!x.empty()) x[x.size() / 3] = std::numeric_limits<float>::quiet_NaN();
  return x;
}

bool same_bits(std::vector<float> const& a, std::vector<float> const& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

TEST_CASE("cuda fp8 tiles == CPU reference") {
  for (auto mk : {std::pair<index_t, index_t>{1, 1}, {5, 129}, {130, 300}, {257, 1000}}) {
    index_t const m = mk.first, k = mk.second;
    for (tile t : {tile_1x128, tile_128x128, tile_128x1})
      for (scale_format fmt : {scale_format::fp32, scale_format::ue8m0}) {
        auto x = random_matrix(m, k, 7);
        index_t const sr = (m + t.rows - 1) / t.rows, sc = (k + t.cols - 1) / t.cols;
        std::vector<std::uint8_t> q(m * k);
        std::vector<float> s(sr * sc);
        reference::fp8_quantize_rows<float>(host_view(x.data(), m, k), host_view(q.data(), m, k), host_view(s.data(), sr, sc), t, fmt, 0, sr);
        dbuf<float> dx(x);
        dbuf<std::uint8_t> dq(q.size());
        dbuf<float> ds(s.size());
        qc::fp8_quantize<float>(dx.v<float const>(m, k), dq.v(m, k), ds.v(sr, sc), t, fmt);
        CHECK(dq.get() == q);
        CHECK(same_bits(ds.get(), s));
        dbuf<float> dy(x.size());
        qc::fp8_dequantize(dq.v<std::uint8_t const>(m, k), ds.v<float const>(sr, sc), dy.v(m, k), t);
        std::vector<float> y(x.size());
        reference::fp8_dequantize_rows<float>(host_view(q.data(), m, k), host_view(s.data(), sr, sc), host_view(y.data(), m, k), t, 0, m);
        CHECK(same_bits(dy.get(), y));
      }
  }
}

TEST_CASE("cuda fp8 1x128 from bfloat16 == CPU reference") {
  index_t const m = 9, k = 300;
  auto xf = random_matrix(m, k, 3);
  std::vector<bfloat16> x(xf.size());
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = bfloat16(xf[i]);
  std::vector<std::uint8_t> q(m * k);
  std::vector<float> s(m * 3);
  reference::fp8_quantize_rows<bfloat16>(host_view(x.data(), m, k), host_view(q.data(), m, k), host_view(s.data(), m, 3), tile_1x128,
                                         scale_format::ue8m0, 0, m);
  dbuf<bfloat16> dx(x);
  dbuf<std::uint8_t> dq(q.size());
  dbuf<float> ds(s.size());
  qc::fp8_quantize<bfloat16>(dx.v<bfloat16 const>(m, k), dq.v(m, k), ds.v(m, 3), tile_1x128, scale_format::ue8m0);
  CHECK(dq.get() == q);
  CHECK(same_bits(ds.get(), s));
  std::vector<std::uint8_t> mq(m * k / 2 + 6), ms(m * 10);
  // MXFP4 from bf16 (K = 300 is not a multiple of 32: use the first 288 columns through a strided view)
  reference::mx_quantize_rows<e2m1_format, bfloat16>(tensor_view<bfloat16 const, 2>(x.data(), {m, 288}, {k, 1}), host_view(mq.data(), m, 144),
                                                     host_view(ms.data(), m, 9), mx_rule::rceil, 0, m);
  dbuf<std::uint8_t> dmq(m * 144), dms(m * 9);
  qc::mx_quantize<bfloat16>(qc::dview<bfloat16 const, 2>(dx.p, {m, 288}, {k, 1}), dmq.v(m, 144), dms.v(m, 9), mx_element::e2m1, mx_rule::rceil);
  mq.resize(m * 144);
  ms.resize(m * 9);
  CHECK(dmq.get() == mq);
  CHECK(dms.get() == ms);
}

TEST_CASE("cuda MX and NVFP4 == CPU reference") {
  index_t const m = 37, k = 320;
  auto x = random_matrix(m, k, 9);
  dbuf<float> dx(x);
  for (mx_element e : {mx_element::e4m3, mx_element::e5m2, mx_element::e3m2, mx_element::e2m3, mx_element::e2m1})
    for (mx_rule rule : {mx_rule::floor, mx_rule::rceil}) {
      index_t const qc = mx_code_columns(e, k);
      std::vector<std::uint8_t> q(m * qc), s(m * k / 32);
      visit(e, [&]<class F>(F) {
        reference::mx_quantize_rows<F, float>(host_view(x.data(), m, k), host_view(q.data(), m, qc), host_view(s.data(), m, k / 32), rule, 0, m);
      });
      dbuf<std::uint8_t> dq(q.size()), ds(s.size());
      qc::mx_quantize<float>(dx.v<float const>(m, k), dq.v(m, qc), ds.v(m, k / 32), e, rule);
      CHECK(dq.get() == q);
      CHECK(ds.get() == s);
      dbuf<float> dy(x.size());
      qc::mx_dequantize(dq.v<std::uint8_t const>(m, qc), ds.v<std::uint8_t const>(m, k / 32), dy.v(m, k), e);
      std::vector<float> y(x.size());
      visit(e, [&]<class F>(F) {
        reference::mx_dequantize_rows<F, float>(host_view(q.data(), m, qc), host_view(s.data(), m, k / 32), host_view(y.data(), m, k), 0, m);
      });
      CHECK(same_bits(dy.get(), y));
    }
  float const g = reference::nvfp4_scale_from_amax(reference::finite_amax_bits<float>(host_view(x.data(), m, k), 0, m));
  CHECK(qc::nvfp4_tensor_scale<float>(dx.v<float const>(m, k)) == g);
  std::vector<std::uint8_t> q(m * k / 2), s(m * k / 16);
  reference::nvfp4_quantize_rows<float>(host_view(x.data(), m, k), host_view(q.data(), m, k / 2), host_view(s.data(), m, k / 16), g, 0, m);
  dbuf<std::uint8_t> dq(q.size()), ds(s.size());
  qc::nvfp4_quantize<float>(dx.v<float const>(m, k), dq.v(m, k / 2), ds.v(m, k / 16), g);
  CHECK(dq.get() == q);
  CHECK(ds.get() == s);
  {
    std::vector<std::uint8_t> qd(q.size()), sd(s.size());
    reference::nvfp4_quantize_rows<float>(host_view(x.data(), m, k), host_view(qd.data(), m, k / 2), host_view(sd.data(), m, k / 16), g, 0,
                                          m, k3::quant::nvfp4_rounding::divide);
    dbuf<std::uint8_t> dqd(q.size()), dsd(s.size());
    qc::nvfp4_quantize<float>(dx.v<float const>(m, k), dqd.v(m, k / 2), dsd.v(m, k / 16), g, nullptr, k3::quant::nvfp4_rounding::divide);
    CHECK(dqd.get() == qd);
    CHECK(dsd.get() == sd);
  }
  dbuf<float> dy(x.size());
  qc::nvfp4_dequantize(dq.v<std::uint8_t const>(m, k / 2), ds.v<std::uint8_t const>(m, k / 16), g, dy.v(m, k));
  std::vector<float> y(x.size());
  reference::nvfp4_dequantize_rows<float>(host_view(q.data(), m, k / 2), host_view(s.data(), m, k / 16), g, host_view(y.data(), m, k), 0, m);
  CHECK(same_bits(dy.get(), y));
}

TEST_CASE("cuda block-scaled GEMM == CPU reference bit for bit") {
  for (auto mnk : {std::tuple<index_t, index_t, index_t>{1, 1, 1}, {33, 200, 300}, {130, 257, 512}}) {
    auto const [m_, n_, k_] = mnk;
    index_t const m = m_, n = n_, k = k_;  // named copies: clang 14 lambdas cannot capture bindings
    auto a = random_matrix(m, k, 1), b = random_matrix(n, k, 2);
    a[a.size() / 3] = 1.0f;  // no NaN here
    b[b.size() / 3] = 1.0f;
    index_t const kb = (k + 127) / 128, nb = (n + 127) / 128;
    std::vector<std::uint8_t> qa(m * k), qb(n * k);
    std::vector<float> sa(m * kb), sb(nb * kb), c(m * n);
    reference::fp8_quantize_rows<float>(host_view(a.data(), m, k), host_view(qa.data(), m, k), host_view(sa.data(), m, kb), tile_1x128,
                                        scale_format::fp32, 0, m);
    reference::fp8_quantize_rows<float>(host_view(b.data(), n, k), host_view(qb.data(), n, k), host_view(sb.data(), nb, kb), tile_128x128,
                                        scale_format::fp32, 0, nb);
    reference::fp8_block_gemm_rows(host_view(qa.data(), m, k), host_view(sa.data(), m, kb), host_view(qb.data(), n, k),
                                   host_view(sb.data(), nb, kb), host_view(c.data(), m, n), 0, m);
    dbuf<std::uint8_t> dqa(qa), dqb(qb);
    dbuf<float> dsa(sa), dsb(sb), dc(c.size());
    qc::fp8_block_gemm(dqa.v<std::uint8_t const>(m, k), dsa.v<float const>(m, kb), dqb.v<std::uint8_t const>(n, k),
                         dsb.v<float const>(nb, kb), dc.v(m, n));
    CHECK(same_bits(dc.get(), c));
  }
}

TEST_CASE("cuda wrappers reject broadcast (stride-0) or overlapping outputs, naming them (host-side check, before any launch)") {
  // The checks read only the views' pointers and strides: host memory stands in for device memory.
  index_t const m = 4, k = 256;
  std::vector<float> f(std::size_t(4 * m * k));
  std::vector<std::uint8_t> b(std::size_t(4 * m * k));
  auto err = [](auto&& fn) { return k3::test::error_of(fn); };
  auto bcast = [](std::string const& e, char const* arg) {
    return e.find(std::string("argument '") + arg + "'") != std::string::npos && e.find("stride 0") != std::string::npos;
  };
  auto fv = [&](std::size_t off, index_t r, index_t c) { return qc::dview<float, 2>(f.data() + off, {r, c}); };
  auto bv = [&](std::size_t off, index_t r, index_t c) { return qc::dview<std::uint8_t, 2>(b.data() + off, {r, c}); };
  qc::dview<float const, 2> const x = fv(0, m, k);
  qc::dview<std::uint8_t, 2> const qb(b.data(), {m, k}, {0, 1});
  qc::dview<float, 2> const sb(f.data() + 2 * m * k, {m, k / 128}, {1, 0});
  qc::dview<float, 2> const yb(f.data() + 2 * m * k, {m, k}, {0, 1});
  CHECK(bcast(err([&] { qc::fp8_quantize<float>(x, qb, fv(2 * m * k, m, k / 128), tile_1x128, scale_format::fp32); }), "q"));
  CHECK(bcast(err([&] { qc::fp8_quantize<float>(x, bv(0, m, k), sb, tile_1x128, scale_format::fp32); }), "scales"));
  qc::dview<std::uint8_t const, 2> const q = bv(0, m, k);
  qc::dview<float const, 2> const s = fv(3 * m * k, m, k / 128);
  CHECK(bcast(err([&] { qc::fp8_dequantize(q, s, yb, tile_1x128); }), "y"));
  std::string e = err([&] { qc::fp8_dequantize(q, s, fv(3 * m * k - 5, m, k), tile_1x128); });
  CHECK((e.find("'y'") != std::string::npos && e.find("'scales'") != std::string::npos && e.find("overlap") != std::string::npos));
  qc::dview<std::uint8_t, 2> const sb8(b.data() + 2 * m * k, {m, k / 32}, {0, 1});
  CHECK(bcast(err([&] { qc::mx_quantize<float>(x, bv(0, m, k), sb8, mx_element::e4m3, mx_rule::floor); }), "scales"));
  CHECK(bcast(err([&] { qc::mx_dequantize(q, bv(2 * m * k, m, k / 32), yb, mx_element::e4m3); }), "y"));
  CHECK(bcast(err([&] { qc::nvfp4_quantize<float>(x, qc::dview<std::uint8_t, 2>(b.data(), {m, k / 2}, {1, 0}), bv(2 * m * k, m, k / 16), 1.f); }), "q"));
  CHECK(bcast(err([&] { qc::nvfp4_dequantize(bv(0, m, k / 2), bv(2 * m * k, m, k / 16), 1.f, yb); }), "y"));
  e = err([&] { qc::nvfp4_quantize<float>(x, bv(0, m, k / 2), bv(10, m, k / 16), 1.f); });
  CHECK((e.find("'scales'") != std::string::npos && e.find("'q'") != std::string::npos && e.find("overlap") != std::string::npos));
  qc::dview<float const, 2> const sbw = fv(3 * m * k, 1, k / 128);
  CHECK(bcast(err([&] { qc::fp8_block_gemm(q, s, q, sbw, qc::dview<float, 2>(f.data(), {m, m}, {0, 1})); }), "c"));
  e = err([&] { qc::fp8_block_gemm(q, s, q, sbw, fv(3 * m * k, m, m)); });
  CHECK((e.find("'c'") != std::string::npos && e.find("overlap") != std::string::npos));
}
