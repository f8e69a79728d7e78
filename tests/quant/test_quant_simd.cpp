// k3/quant/simd.hpp store paths: the AVX-512 row kernels write codes either with plain stores
// or (store_mode::streaming) with non-temporal stores of whole cache lines realigned in
// registers. Both must give the reference's bytes for every destination alignment, row length
// (tails shorter than a line, rows shorter than one line), row stride and row count (fewer rows
// than threads), and must not touch a byte outside the rows.
#include <doctest/doctest.h>

#include <cstring>
#include <limits>

#include "quant_test_util.hpp"

using namespace k3;
using namespace k3::quant;

namespace {

using arch = cpu::threads<>::arch_type;
constexpr std::uint8_t guard = 0xA5;
constexpr index_t pad = 160;  // guard bytes before and after the codes

// Inputs for m x k with the special blocks the kernels branch on: a NaN block, an Inf block,
// an all-zero block, blocks with tiny values (E4M3 subnormal codes), set at row-dependent
// columns so that each row has a different mix.
std::vector<bfloat16> special_input(index_t m, index_t k, std::uint32_t seed, index_t block) {
  std::vector<float> x = qt::random_matrix(m, k, seed);
  index_t const nb = qt::cdiv(k, block);
  for (index_t i = 0; i < m; ++i) {
    auto at = [&](index_t b, index_t j) -> float& { return x[static_cast<std::size_t>(i * k + std::min(k - 1, b * block + j))]; };
    index_t const b = (i * 5 + 1) % nb;
    switch (i % 4) {
      case 0: at(b, 3) = std::numeric_limits<float>::quiet_NaN(); break;
      case 1: at(b, 0) = -std::numeric_limits<float>::infinity(); break;
      case 2:
        for (index_t j = 0; j < block && b * block + j < k; ++j) at(b, j) = 0.0f;
        break;
      default: at(b, 1) *= 1e6f; break;  // the rest of the block gets E4M3 subnormal codes
    }
  }
  return qt::to_bf16(x);
}

struct outbuf {
  std::vector<std::uint8_t> mem;
  index_t off, ld, m, cols;
  outbuf(index_t m_, index_t cols_, index_t ld_, index_t off_) : off(off_), ld(ld_), m(m_), cols(cols_) {
    mem.assign(static_cast<std::size_t>(2 * pad + 64 + std::max<index_t>(0, m - 1) * ld + cols), guard);
  }
  // the codes start `off` bytes past a 64-byte boundary
  std::uint8_t* base() {
    auto const p = reinterpret_cast<std::uintptr_t>(mem.data() + pad);
    return reinterpret_cast<std::uint8_t*>((p + 63) / 64 * 64) + off;
  }
  tensor_view<std::uint8_t, 2> view() {
    return tensor_view<std::uint8_t, 2>(base(), {m, cols}, {ld, 1});
  }
  // codes row by row, compact
  std::vector<std::uint8_t> codes() {
    std::vector<std::uint8_t> r;
    for (index_t i = 0; i < m; ++i) r.insert(r.end(), base() + i * ld, base() + i * ld + cols);
    return r;
  }
  // every byte outside the rows still holds the guard
  long touched_outside() {
    long bad = 0;
    std::uint8_t const* b = base();
    for (std::size_t p = 0; p < mem.size(); ++p) {
      index_t const d = static_cast<index_t>(mem.data() + p - b);
      bool const inside = d >= 0 && d < m * ld && d / ld < m && d % ld < cols;
      bad += !inside && mem[p] != guard;
    }
    return bad;
  }
};

bool same_bits(std::vector<float> const& a, std::vector<float> const& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

// Every way the row kernels can run, whatever the host's own tuning: both store modes forced,
// `automatic` resolved each way by its threshold, and the input prefetch on and off (it changes
// no result; the wrap into the next row is exercised by the strided rows).
struct store_config {
  store_mode mode;
  k3::quant::tuning tune;
  bool streams;  // what the kernel should end up doing
};
std::vector<store_config> store_configs() {
  return {{store_mode::streaming, {0, ~std::size_t{0}}, true},
          {store_mode::cached, {2048, 0}, false},
          {store_mode::automatic, {2048, 0}, true},
          {store_mode::automatic, {0, ~std::size_t{0}}, false}};
}

TEST_CASE("tuning: the automatic store mode streams from the threshold on, forced modes win") {
  k3::quant::tuning const t{2048, 1000};
  CHECK_FALSE(t.stream(store_mode::automatic, 999));
  CHECK(t.stream(store_mode::automatic, 1000));
  CHECK_FALSE(t.stream(store_mode::cached, 1 << 30));
  CHECK(t.stream(store_mode::streaming, 1));
  CHECK_FALSE(k3::quant::tuning{}.stream(store_mode::automatic, ~std::size_t{0} - 1));
}

TEST_CASE("tuning: the defaults follow the cache sizes, and the host's come from the host's caches") {
  using k3::quant::tuning;
  // a 2 MiB private L2 (the Xeon VM measured): prefetch 2048 ahead, stream past eight L2s
  tuning const big = tuning::for_caches({48 << 10, 2 << 20, 105 << 20});
  CHECK(big.prefetch_distance == 2048);
  CHECK(big.stream_min_bytes == (std::size_t{16} << 20));
  CHECK(tuning::for_caches({48 << 10, 4 << 20, 0}).stream_min_bytes == (std::size_t{32} << 20));
  // a smaller L2 (the Zen 4 VM), or nothing reported: the plain code
  for (k3::cache_sizes c : {k3::cache_sizes{32 << 10, 1 << 20, 32 << 20}, k3::cache_sizes{}}) {
    tuning const t = tuning::for_caches(c);
    CHECK(t.prefetch_distance == 0);
    CHECK(t.stream_min_bytes == ~std::size_t{0});
  }
  tuning const h = tuning::host(), want = tuning::for_caches(k3::host_cache_sizes());
  CHECK(h.prefetch_distance == want.prefetch_distance);
  CHECK(h.stream_min_bytes == want.stream_min_bytes);
  // the options carry it: a forced mode reaches the kernels through fp8_quantize_options
  k3::quant::fp8_quantize_options const o{.stores = store_mode::streaming, .tuning = big};
  CHECK(o.tuning.stream(o.stores, 1));
}

TEST_CASE("simd stores: 1x128 E4M3 of bf16, streaming and cached, every alignment against the reference") {
  cpu::serial ser;
  cpu::simd<> sim;
  cpu::threads<> thr(4);
  index_t const ks[] = {1, 3, 63, 64, 65, 127, 128, 130, 200, 256, 1000, 2048 + 128 + 72, 7168};
  index_t const ms[] = {1, 2, 3, 7, 37};
  index_t const offs[] = {0, 1, 16, 33, 48, 63};
  long cases = 0;
  for (index_t k : ks)
    for (index_t m : ms) {
      std::vector<bfloat16> const x = special_input(m, k, static_cast<std::uint32_t>(k * 31 + m), 128);
      auto const xv = host_view(x.data(), m, k);
      for (scale_format fmt : {scale_format::fp32, scale_format::ue8m0}) {
        index_t const sc = qt::cdiv(k, 128);
        std::vector<std::uint8_t> want(static_cast<std::size_t>(m * k));
        std::vector<float> want_s(static_cast<std::size_t>(m * sc));
        fp8_quantize(ser, fp8_quantize_args<bfloat16>{.x = xv, .q = host_view(want.data(), m, k), .scales = host_view(want_s.data(), m, sc)},
                     {.tile = tile_1x128, .format = fmt});
        for (index_t off : offs)
          for (index_t ld : {k, k + 5})
            for (store_config const& cfg : store_configs()) {
              for (int which = 0; which < 2; ++which) {
                outbuf q(m, k, ld, off);
                std::vector<float> s(static_cast<std::size_t>(m * sc), -1.0f);
                if (which == 0)
                  simd_impl::fp8_quantize<arch>(thr, const_view<bfloat16, 2>(xv), q.view(), host_view(s.data(), m, sc), tile_1x128, fmt, cfg.mode,
                                                cfg.tune);
                else
                  simd_impl::fp8_quantize<arch>(sim, const_view<bfloat16, 2>(xv), q.view(), host_view(s.data(), m, sc), tile_1x128, fmt, cfg.mode,
                                                cfg.tune);
                INFO("k=" << k << " m=" << m << " off=" << off << " ld=" << ld << " streaming=" << cfg.streams
                           << " prefetch=" << cfg.tune.prefetch_distance << " threads=" << (which == 0));
                CHECK(q.codes() == want);
                CHECK(same_bits(s, want_s));
                CHECK(q.touched_outside() == 0);
                ++cases;
              }
            }
      }
    }
  CHECK(cases == 13 * 5 * 2 * 6 * 2 * 4 * 2);
}

TEST_CASE("simd stores: MXFP8 (E4M3) of bf16, streaming and cached, every alignment against the reference") {
  cpu::serial ser;
  cpu::threads<> thr(4);
  index_t const ks[] = {32, 64, 96, 128, 192, 1024 + 64, 7168};
  index_t const ms[] = {1, 3, 6, 20};
  index_t const offs[] = {0, 5, 16, 32, 47, 63};
  for (index_t k : ks)
    for (index_t m : ms) {
      std::vector<bfloat16> const x = special_input(m, k, static_cast<std::uint32_t>(k * 17 + m), 32);
      auto const xv = host_view(x.data(), m, k);
      for (mx_rule rule : {mx_rule::floor, mx_rule::rceil}) {
        index_t const sc = k / 32;
        std::vector<std::uint8_t> want(static_cast<std::size_t>(m * k)), want_s(static_cast<std::size_t>(m * sc));
        mx_quantize(ser, mx_quantize_args<bfloat16>{.x = xv, .q = host_view(want.data(), m, k), .scales = host_view(want_s.data(), m, sc)},
                    {.element = mx_element::e4m3, .rule = rule});
        for (index_t off : offs)
          for (index_t ld : {k, k + 3})
            for (store_config const& cfg : store_configs()) {
              outbuf q(m, k, ld, off);
              std::vector<std::uint8_t> s(static_cast<std::size_t>(m * sc), 0);
              simd_impl::mx_quantize<arch, e4m3_format>(thr, const_view<bfloat16, 2>(xv), q.view(), host_view(s.data(), m, sc), rule, cfg.mode,
                                                        cfg.tune);
              INFO("k=" << k << " m=" << m << " off=" << off << " ld=" << ld << " streaming=" << cfg.streams << " prefetch=" << cfg.tune.prefetch_distance);
              CHECK(q.codes() == want);
              CHECK(s == want_s);
              CHECK(q.touched_outside() == 0);
            }
      }
    }
}

TEST_CASE("simd row kernels: MXFP4 (E2M1) of bf16 with and without the input prefetch, rows strided both sides") {
  cpu::serial ser;
  cpu::threads<> thr(3);
  for (index_t k : {32, 64, 2048, 2080, 7168})
    for (index_t m : {1, 2, 5, 19})
      for (index_t xld : {k, k + 7}) {
        // x's rows xld apart: the prefetch wraps from one row into the next by the stride
        std::vector<bfloat16> const dense = special_input(m, k, static_cast<std::uint32_t>(k * 13 + m), 32);
        std::vector<bfloat16> xs(static_cast<std::size_t>(m * xld), bfloat16(1.0f));
        for (index_t i = 0; i < m; ++i)
          std::copy_n(dense.begin() + i * k, k, xs.begin() + i * xld);
        const_view<bfloat16, 2> const xv(xs.data(), {m, k}, {xld, 1});
        index_t const sc = k / 32;
        for (mx_rule rule : {mx_rule::floor, mx_rule::rceil}) {
          std::vector<std::uint8_t> want(static_cast<std::size_t>(m * k / 2)), want_s(static_cast<std::size_t>(m * sc));
          mx_quantize(ser,
                      mx_quantize_args<bfloat16>{
                          .x = host_view(dense.data(), m, k), .q = host_view(want.data(), m, k / 2), .scales = host_view(want_s.data(), m, sc)},
                      {.element = mx_element::e2m1, .rule = rule});
          for (index_t prefetch : {index_t(0), index_t(2048)}) {
            outbuf q(m, k / 2, k / 2 + 3, 5);
            std::vector<std::uint8_t> s(static_cast<std::size_t>(m * sc), 0);
            simd_impl::mx_quantize<arch, e2m1_format>(thr, xv, q.view(), host_view(s.data(), m, sc), rule, store_mode::automatic,
                                                      k3::quant::tuning{prefetch, ~std::size_t{0}});
            INFO("k=" << k << " m=" << m << " xld=" << xld << " prefetch=" << prefetch);
            CHECK(q.codes() == want);
            CHECK(s == want_s);
            CHECK(q.touched_outside() == 0);
          }
        }
      }
}
