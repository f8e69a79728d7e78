// The vectorised chunked forward of chunk_simd.hpp (simd/threads backends): heads of a
// sequence processed in groups whose size follows the thread count (groups that split a
// grouped-value-head family, ragged last groups, one head, packed sequences shorter than a
// sub-chunk, T = 1), against the serial backend's Eigen formulation; results bitwise
// independent of the thread count. Also its helpers: the register transpose and the
// vectorised chunk inverse against their scalar references, and the threaded gate-bound scan.
#include <doctest/doctest.h>

#include <random>
#include <string>

#include "k3/kda.hpp"
#include "kda/kda_fixture.hpp"

using namespace k3;
using namespace k3::test;

namespace {

void check_groups(kda_case c) {
  typed_data<double> td(make_data(c));
  auto ref = run_forward(td, kda::algorithm::chunk);  // serial backend: Eigen formulation
  auto rec = run_forward(td, kda::algorithm::recurrent);
  fwd_result first;
  bool have_first = false;
  for (int threads : {1, 2, 3, 4, 5, 8}) {
    INFO("T=" << c.T << " H=" << c.H << " HV=" << c.HV << " K=" << c.K << " V=" << c.V << " varlen=" << c.cu.size()
              << " gate=" << int(c.gate) << " threads=" << threads);
    auto f = run_forward(td, kda::algorithm::chunk, cpu::threads<>(threads));
    CHECK(rel_rms(f.o, ref.o) < 1e-13);
    CHECK(rel_rms(f.ht, ref.ht) < 1e-13);
    CHECK(rel_rms(f.o, rec.o) < 1e-12);
    CHECK(rel_rms(f.ht, rec.ht) < 1e-12);
    if (!have_first) {
      first = f;
      have_first = true;
    } else {
      CHECK(first.o == f.o);  // bitwise: the grouping changes with the thread count, the per-head code does not
      CHECK(first.ht == f.ht);
    }
  }
  auto s = run_forward(td, kda::algorithm::chunk, cpu::simd<>{});
  CHECK(s.o == first.o);
  CHECK(s.ht == first.ht);
}

}  // namespace

TEST_CASE("chunked forward head groups: any group split, ragged groups, grouped value heads") {
  for (gate_kind gk : {gate_kind::lower_bound, gate_kind::logsigmoid}) {
    // HV = 6 over H = 2 (G = 3): groups of 2 or 4 value heads straddle the q/k heads
    check_groups({.B = 1, .T = 150, .H = 2, .HV = 6, .K = 16, .V = 20, .gate = gk, .seed = 201});
    // HV = 5 = H: ragged last group for every group size
    check_groups({.B = 1, .T = 70, .H = 5, .HV = 5, .K = 20, .V = 16, .gate = gk, .seed = 202});
    // one head; T = 1
    check_groups({.B = 1, .T = 65, .H = 1, .HV = 1, .K = 16, .V = 16, .gate = gk, .seed = 203});
    check_groups({.B = 3, .T = 1, .H = 2, .HV = 4, .K = 16, .V = 8, .gate = gk, .seed = 204});
    // HV = 2H with 16 value heads (groups of 8), K not a multiple of 16 (transpose tails)
    check_groups({.B = 1, .T = 80, .H = 8, .HV = 16, .K = 36, .V = 12, .gate = gk, .seed = 205});
    // packed sequences shorter than a sub-chunk and a chunk, an empty one, no initial state
    check_groups({.B = 1, .T = 100, .H = 3, .HV = 6, .K = 16, .V = 16, .cu = {0, 1, 3, 3, 20, 84, 100}, .h0 = false, .gate = gk,
                  .seed = 206});
  }
  // float: the AVX-512 transpose path of the intra-chunk factors (K = 40: a 16-column tail)
  kda_case c{.B = 2, .T = 130, .H = 2, .HV = 4, .K = 40, .V = 24, .gate = gate_kind::lower_bound, .seed = 207};
  typed_data<float> tf(make_data(c));
  typed_data<double> td(make_data(c));
  auto ref = run_forward(td, kda::algorithm::recurrent);
  auto f1 = run_forward(tf, kda::algorithm::chunk, cpu::threads<>(1));
  auto f3 = run_forward(tf, kda::algorithm::chunk, cpu::threads<>(3));
  CHECK(rel_rms(f1.o, ref.o) < 1e-5);
  CHECK(rel_rms(f1.ht, ref.ht) < 1e-5);
  CHECK(f1.o == f3.o);
  CHECK(f1.ht == f3.ht);
}

TEST_CASE("transpose_fast equals transpose_into, on the host's Arch and on one the ISA files do not serve") {
  auto run = [](auto tag, auto arch) {
    using T = decltype(tag);
    using Arch = decltype(arch);
    for (index_t rows : {1, 15, 16, 17, 33, 64})
      for (index_t cols : {1, 7, 16, 31, 48, 128}) {
        index_t const lds = cols + 3, ldd = rows + 5;
        std::vector<T> s(std::size_t(rows * lds)), d1(std::size_t(cols * ldd), T(-1)), d2 = d1;
        for (std::size_t i = 0; i < s.size(); ++i) s[i] = T(i) * T(0.5);
        kda::detail::transpose_into(s.data(), rows, cols, lds, d1.data(), ldd);
        kda::detail::transpose_fast<Arch>(s.data(), rows, cols, lds, d2.data(), ldd);
        INFO("rows=" << rows << " cols=" << cols << " portable=" << std::is_same_v<Arch, xsimd::generic>);
        CHECK(d1 == d2);
      }
  };
  run(float{}, xsimd::default_arch{});
  run(double{}, xsimd::default_arch{});
  run(float{}, xsimd::generic{});
}

// small_gemm::run_t reads A transposed in place (the backward's A^T B products): the same
// products in the same order as run() on a transposed copy, so bit for bit the same, for every
// init mode and shape (dense, lower, upper triangular), partial register tiles (m not a
// multiple of the tile rows, n of the tile width) and padded leading dimensions.
TEST_CASE("small_gemm::run_t equals run on the transposed copy") {
  auto check = [](auto tag) {
    using T = decltype(tag);
    using gemm = kda::detail::small_gemm<xsimd::default_arch, T>;
    index_t const L = gemm::L;
    std::mt19937 rng(7);
    std::uniform_real_distribution<double> ud(-1, 1);
    for (index_t m : {1, 5, 8, 13, 64})
      for (index_t k : {1, 9, 16, 64})
        for (index_t n : {L, 2 * L, 3 * L, 5 * L})
          for (int shape : {0, 1, 2}) {
            if (shape != 0 && k != m) continue;  // the triangular shapes are square
            index_t const lda = m + 3, ldb = n + L, ldc = n + 2 * L, ldat = k + 1;
            std::vector<T> at(std::size_t(k * lda)), a(std::size_t(m * ldat)), b(std::size_t(k * ldb)), rs(static_cast<std::size_t>(m));
            for (auto& x : at) x = T(ud(rng));
            for (auto& x : b) x = T(ud(rng));
            for (auto& x : rs) x = T(ud(rng));
            if (shape == 2)  // upper triangular A: the zeros inside a diagonal block are multiplied
              for (index_t p = 0; p < k; ++p)
                for (index_t i = p + 1; i < m; ++i) at[std::size_t(p * lda + i)] = T(0);
            kda::detail::transpose_into(at.data(), k, m, lda, a.data(), ldat);
            for (auto init : {gemm::zero, gemm::accumulate, gemm::row_scaled}) {
              std::vector<T> c1(static_cast<std::size_t>(m * ldc));
              for (auto& x : c1) x = T(ud(rng));
              std::vector<T> c2 = c1;
              gemm::run(m, n, k, a.data(), ldat, b.data(), ldb, c1.data(), ldc, init, rs.data(), shape);
              gemm::run_t(m, n, k, at.data(), lda, b.data(), ldb, c2.data(), ldc, init, rs.data(), shape);
              INFO("m=" << m << " n=" << n << " k=" << k << " shape=" << shape << " init=" << int(init));
              CHECK(c1 == c2);
            }
          }
  };
  check(float{});
  check(double{});
}

TEST_CASE("chunk_inverse_simd equals chunk_inverse") {
  auto run = [](auto tag) {
    using T = decltype(tag);
    std::mt19937_64 rng(301);
    std::normal_distribution<double> nd(0.0, 0.3);
    for (index_t c : {1, 2, 5, 16, 17, 40, 63, 64}) {
      kda::detail::chunk_workspace<T> w1(16, 16, false), w2(16, 16, false);
      for (index_t i = 0; i < kda::detail::chunk_size; ++i) {
        w1.beta(i) = T(0.5 + 0.5 * std::abs(nd(rng)));
        for (index_t j = 0; j < kda::detail::chunk_size; ++j) {
          w1.KK(i, j) = T(nd(rng));
          w1.A(i, j) = T(-3);  // stale values must not leak in
        }
      }
      w2.beta = w1.beta;
      w2.KK = w1.KK;
      w2.A = w1.A;
      kda::detail::chunk_inverse(w1, c);
      kda::detail::chunk_inverse_simd<xsimd::default_arch>(w2, c);
      double err = 0, ref = 0;
      for (index_t i = 0; i < c; ++i)
        for (index_t j = 0; j <= i; ++j) {
          err = std::max(err, std::abs(double(w1.A(i, j) - w2.A(i, j))));
          ref = std::max(ref, std::abs(double(w1.A(i, j))));
        }
      for (index_t i = 0; i < c; ++i)
        for (index_t j = i + 1; j < kda::detail::chunk_size; ++j) CHECK(w2.A(i, j) == T(0));  // zero above the diagonal
      INFO("c=" << c);
      CHECK(err <= ref * (sizeof(T) == 4 ? 1e-5 : 1e-13));
    }
  };
  run(float{});
  run(double{});
}

TEST_CASE("the threaded forward rejects a gate below its bound like the serial one") {
  kda_case c{.B = 2, .T = 90, .H = 1, .HV = 2, .K = 16, .V = 8, .gate = gate_kind::lower_bound, .lb = -2, .seed = 401};
  kda_data64 d = make_data(c);
  d.g[std::size_t(((1 * c.T + 87) * c.HV + 1) * c.K + 5)] = -2.5;  // batch row 1, token 87 (the last scan part), head 1
  d.g[std::size_t(((1 * c.T + 88) * c.HV + 0) * c.K + 2)] = -3;
  typed_data<float> tf(d);
  auto message = [&](auto const& be) {
    try {
      run_forward(tf, kda::algorithm::chunk, be);
    } catch (k3::error const& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  std::string const serial = message(cpu::serial{});
  CHECK(serial.find("[1, 87, 1, 5]") != std::string::npos);
  CHECK(message(cpu::threads<>(2)) == serial);
  CHECK(message(cpu::threads<>(5)) == serial);
  CHECK(message(cpu::simd<>{}) == serial);
  // exactly at the bound is fine
  d = make_data(c);
  d.g[7] = -2;
  typed_data<float> ok(d);
  CHECK_NOTHROW(run_forward(ok, kda::algorithm::chunk, cpu::threads<>(2)));
}
