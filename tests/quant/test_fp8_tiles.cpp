// DeepSeek-style FP8 tiles (1x128, 128x128, 128x1), fp32 and UE8M0 scales: per-tile scale rule,
// per-element codes, error bounds, bytes identical across backends and strides, special
// tiles, re-quantisation to 128x1, and argument errors.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>

#include "quant_test_util.hpp"

using namespace k3;
using namespace k3::quant;

namespace {

struct result {
  std::vector<std::uint8_t> q;
  std::vector<float> s;
};

template <class B, class T>
result run(B const& b, std::vector<T> const& x, index_t m, index_t k, tile t, scale_format fmt) {
  result r;
  r.q.assign(static_cast<std::size_t>(m * k), 0xAA);
  r.s.assign(static_cast<std::size_t>(qt::cdiv(m, t.rows) * qt::cdiv(k, t.cols)), -1.0f);
  fp8_quantize(b,
               fp8_quantize_args<T>{.x = host_view(x.data(), m, k),
                                    .q = host_view(r.q.data(), m, k),
                                    .scales = host_view(r.s.data(), qt::cdiv(m, t.rows), qt::cdiv(k, t.cols))},
               {.tile = t, .format = fmt});
  return r;
}

bool same_bits(std::vector<float> const& a, std::vector<float> const& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (k3::detail::bit_cast<std::uint32_t>(a[i]) != k3::detail::bit_cast<std::uint32_t>(b[i])) return false;
  return true;
}

// Independent check of one quantisation against the recipe, tile by tile.
template <class T>
void check_recipe(std::vector<T> const& x, index_t m, index_t k, tile t, scale_format fmt, result const& r) {
  index_t const sr = qt::cdiv(m, t.rows), sc = qt::cdiv(k, t.cols);
  long bad_scale = 0, bad_code = 0, bad_err = 0;
  for (index_t rb = 0; rb < sr; ++rb)
    for (index_t cb = 0; cb < sc; ++cb) {
      double amax = 0;
      for (index_t i = rb * t.rows; i < std::min(m, (rb + 1) * t.rows); ++i)
        for (index_t j = cb * t.cols; j < std::min(k, (cb + 1) * t.cols); ++j)
          amax = std::max(amax, std::fabs(double(float(x[i * k + j]))));
      float const want = std::max(float(amax), 1e-4f) / 448.0f;
      float const s = r.s[rb * sc + cb];
      if (fmt == scale_format::fp32) {
        bad_scale += s != want;
      } else {
        int e;
        double fr = std::frexp(double(s), &e);
        bad_scale += !(fr == 0.5 && s >= want && s / 2 < want);
      }
      for (index_t i = rb * t.rows; i < std::min(m, (rb + 1) * t.rows); ++i)
        for (index_t j = cb * t.cols; j < std::min(k, (cb + 1) * t.cols); ++j) {
          float const xv = float(x[i * k + j]);
          std::uint8_t const c = r.q[i * k + j];
          bad_code += c != encode<e4m3_format>(xv * (1.0f / s));
          double const deq = double(decode<e4m3_format>(c)) * s;
          bad_err += std::fabs(deq - xv) > qt::element_bound<e4m3_format>(std::fabs(xv), s);
        }
    }
  CHECK(bad_scale == 0);
  CHECK(bad_code == 0);
  CHECK(bad_err == 0);
}

}  // namespace

TEST_CASE("fp8 tiles: recipe, error bound and backend agreement on awkward shapes") {
  cpu::serial ser;
  cpu::simd<> sim;
  cpu::threads<> thr(3);
  struct shape {
    index_t m, k;
  };
  std::uint32_t seed = 1;
  for (shape sh : {shape{1, 1}, shape{1, 128}, shape{3, 127}, shape{5, 129}, shape{130, 300}, shape{257, 64}, shape{17, 1000}}) {
    for (tile t : {tile_1x128, tile_128x128, tile_128x1, tile{4, 32}}) {
      for (scale_format fmt : {scale_format::fp32, scale_format::ue8m0}) {
        CAPTURE(sh.m);
        CAPTURE(sh.k);
        CAPTURE(t.rows);
        CAPTURE(t.cols);
        CAPTURE(int(fmt));
        auto xf = qt::random_matrix(sh.m, sh.k, seed++);
        auto ref = run(ser, xf, sh.m, sh.k, t, fmt);
        check_recipe(xf, sh.m, sh.k, t, fmt, ref);
        for (auto const& other : {run(sim, xf, sh.m, sh.k, t, fmt), run(thr, xf, sh.m, sh.k, t, fmt)}) {
          CHECK(other.q == ref.q);
          CHECK(same_bits(other.s, ref.s));
        }
        auto xb = qt::to_bf16(xf);
        auto refb = run(ser, xb, sh.m, sh.k, t, fmt);
        check_recipe(xb, sh.m, sh.k, t, fmt, refb);
        auto thrb = run(thr, xb, sh.m, sh.k, t, fmt);
        CHECK(thrb.q == refb.q);
        CHECK(same_bits(thrb.s, refb.s));
        // dequantize reproduces q·s
        std::vector<float> y(xf.size());
        fp8_dequantize(thr,
                       fp8_dequantize_args<float>{.q = host_view(ref.q.data(), sh.m, sh.k),
                                                  .scales = host_view(ref.s.data(), qt::cdiv(sh.m, t.rows), qt::cdiv(sh.k, t.cols)),
                                                  .y = host_view(y.data(), sh.m, sh.k)},
                       {.tile = t});
        long bad = 0;
        for (index_t i = 0; i < sh.m; ++i)
          for (index_t j = 0; j < sh.k; ++j)
            bad += y[i * sh.k + j] != decode<e4m3_format>(ref.q[i * sh.k + j]) * ref.s[(i / t.rows) * qt::cdiv(sh.k, t.cols) + j / t.cols];
        CHECK(bad == 0);
      }
    }
  }
}

TEST_CASE("fp8 tiles: strided and transposed inputs give the contiguous result") {
  index_t const m = 70, k = 260, ld = 300;
  auto big = qt::random_matrix(m, ld, 99);
  std::vector<float> packed(static_cast<std::size_t>(m * k));
  for (index_t i = 0; i < m; ++i)
    for (index_t j = 0; j < k; ++j) packed[i * k + j] = big[i * ld + j];
  cpu::threads<> thr(2);
  auto want = run(cpu::serial{}, packed, m, k, tile_1x128, scale_format::fp32);
  // row stride ld (vector path)
  result r1{std::vector<std::uint8_t>(m * k), std::vector<float>(m * 3)};
  tensor_view<float const, 2> xs(big.data(), {m, k}, {ld, 1});
  fp8_quantize(thr, fp8_quantize_args<float>{.x = xs, .q = host_view(r1.q.data(), m, k), .scales = host_view(r1.s.data(), m, 3)});
  CHECK(r1.q == want.q);
  CHECK(same_bits(r1.s, want.s));
  // a transposed view: x^T stored column-major (inner stride != 1 -> reference path)
  std::vector<float> xt(static_cast<std::size_t>(m * k));
  for (index_t i = 0; i < m; ++i)
    for (index_t j = 0; j < k; ++j) xt[j * m + i] = packed[i * k + j];
  tensor_view<float const, 2> xtv(xt.data(), {m, k}, {1, m});
  result r2{std::vector<std::uint8_t>(m * k), std::vector<float>(m * 3)};
  fp8_quantize(thr, fp8_quantize_args<float>{.x = xtv, .q = host_view(r2.q.data(), m, k), .scales = host_view(r2.s.data(), m, 3)});
  CHECK(r2.q == want.q);
  CHECK(same_bits(r2.s, want.s));
  // a 3-d tensor flattened to rows
  tensor_view<float const, 3> x3(packed.data(), {7, 10, k});
  auto xm = as_matrix(x3);
  CHECK(xm.extent(0) == 70);
  CHECK(xm.extent(1) == k);
  result r3{std::vector<std::uint8_t>(m * k), std::vector<float>(m * 3)};
  fp8_quantize(thr, fp8_quantize_args<float>{.x = xm, .q = host_view(r3.q.data(), m, k), .scales = host_view(r3.s.data(), m, 3)});
  CHECK(r3.q == want.q);
  tensor_view<float const, 3> bad3(big.data(), {7, 10, k}, {10 * ld + 1, ld, 1});
  CHECK_THROWS_AS(as_matrix(bad3), k3::error);
}

TEST_CASE("fp8 tiles: reference vectors and special tiles") {
  // 464 -> 448 (tie to even, 0x7E), 400 -> 384 under RNE: with amax 448 the scale is exactly 1.
  std::vector<float> x(256, 0.0f);
  x[0] = 448.0f;
  x[1] = 400.0f;
  x[2] = 416.0f;
  x[3] = -0.0f;
  // tile 2: all zero. tile 3 (row 1, first tile): NaN. row 1, second tile: Inf.
  std::vector<float> x2(512, 0.0f);
  for (int j = 0; j < 256; ++j) x2[j] = x[j];
  x2[256 + 5] = std::numeric_limits<float>::quiet_NaN();
  x2[256 + 128 + 9] = -std::numeric_limits<float>::infinity();
  x2[256 + 128 + 10] = 3.0f;
  for (auto const& b : {0, 1}) {
    result r = b == 0 ? run(cpu::serial{}, x2, 2, 256, tile_1x128, scale_format::fp32)
                      : run(cpu::threads<>(2), x2, 2, 256, tile_1x128, scale_format::fp32);
    CHECK(r.s[0] == 1.0f);
    CHECK(r.q[0] == 0x7E);
    CHECK(r.q[1] == 0x7C);  // 384
    CHECK(r.q[2] == 0x7D);
    CHECK(r.q[3] == 0x80);  // -0 kept
    CHECK(r.s[1] == 1e-4f / 448.0f);  // all-zero tile: amax clamped to 1e-4
    for (int j = 128; j < 256; ++j) CHECK(r.q[j] == 0);
    CHECK(std::isnan(r.s[2]));
    CHECK(std::isnan(r.s[3]));
    for (int j = 256; j < 512; ++j) CHECK(r.q[j] == 0x7F);
    std::vector<float> y(512);
    fp8_dequantize(cpu::serial{}, fp8_dequantize_args<float>{
                                      .q = host_view(r.q.data(), 2, 256), .scales = host_view(r.s.data(), 2, 2), .y = host_view(y.data(), 2, 256)});
    for (int j = 256; j < 512; ++j) CHECK(std::isnan(y[j]));
    CHECK(y[0] == 448.0f);
  }
  // NaN/Inf tiles with UE8M0 scales: same documented result (NaN scale, NaN codes), other tiles intact
  for (auto const& r : {run(cpu::serial{}, x2, 2, 256, tile_1x128, scale_format::ue8m0), run(cpu::threads<>(2), x2, 2, 256, tile_1x128, scale_format::ue8m0)}) {
    CHECK(r.s[0] == 1.0f);
    CHECK(std::isnan(r.s[2]));
    CHECK(std::isnan(r.s[3]));
    for (int j = 256; j < 512; ++j) CHECK(r.q[j] == 0x7F);
    CHECK(r.q[1] == 0x7C);
  }
  // UE8M0: amax 448 -> s = 1 exactly; amax 449 -> s = 2.
  std::vector<float> x3(128, 1.0f);
  x3[7] = 449.0f;
  auto r3 = run(cpu::serial{}, x3, 1, 128, tile_1x128, scale_format::ue8m0);
  CHECK(r3.s[0] == 2.0f);
  CHECK(r3.q[7] == encode<e4m3_format>(224.5f));
  x3[7] = 448.0f;
  CHECK(run(cpu::serial{}, x3, 1, 128, tile_1x128, scale_format::ue8m0).s[0] == 1.0f);
  // UE8M0 exponent clamp: the 1e-4 floor keeps s far above 2^-126; huge amax stays finite.
  std::vector<float> x4(128, std::numeric_limits<float>::max());
  auto r4 = run(cpu::serial{}, x4, 1, 128, tile_1x128, scale_format::ue8m0);
  CHECK(r4.s[0] == 0x1p120f);  // FLT_MAX/448 < 2^120
  CHECK(r4.q[0] == encode<e4m3_format>(std::numeric_limits<float>::max() * 0x1p-120f));
}

TEST_CASE("fp8 tiles: every bfloat16 pattern, vector 1x128 path against the reference") {
  // Each 128-wide tile holds one anchor a (its amax, hence its scale) and 127 bf16 patterns with
  // |x| <= a, so all 65536 patterns pass the vector encoder at every anchor: a amax-floor tile
  // (scale 1e-4/448: most small values become E4M3 subnormals), a few ordinary scales, a tile
  // of the largest finite bf16 (fp32-subnormal products), and all NaN/Inf patterns, each in a
  // tile of otherwise ordinary values. The last tile of each row is partial (k % 128 != 0).
  cpu::serial ser;
  cpu::threads<> thr(2);
  auto const bits_of = [](float f) { return static_cast<std::uint16_t>(k3::detail::bit_cast<std::uint32_t>(f) >> 16); };
  auto const bf = [](std::uint16_t u) { return k3::detail::bit_cast<bfloat16>(u); };
  std::vector<std::uint16_t> anchors = {bits_of(1e-6f), bits_of(2.0e-4f), bits_of(0.0172f), bits_of(1.0f), bits_of(448.0f),
                                        bits_of(5.0e7f), 0x7F7F};
  index_t const k = 128 * 6 + 100;
  for (scale_format fmt : {scale_format::fp32, scale_format::ue8m0}) {
    for (std::uint16_t anchor : anchors) {
      float const a = load_as<float>(bf(anchor));
      std::vector<bfloat16> x;
      std::uint32_t u = 0;
      while (u < 0x10000u) {
        std::size_t const col = x.size() % static_cast<std::size_t>(k);
        if (col % 128 == 0) {
          x.push_back((col / 128) % 2 ? bf(static_cast<std::uint16_t>(anchor | 0x8000)) : bf(anchor));
          continue;
        }
        bfloat16 const v = bf(static_cast<std::uint16_t>(u++));
        float const f = load_as<float>(v);
        if (std::isfinite(f) && std::fabs(f) <= a) x.push_back(v);
      }
      // non-finite patterns: one per tile, in tiles of anchor-bounded values
      for (std::uint32_t w = 0x7F80; w < 0x10000u; w += (w == 0x7FFF ? 0xFF81 - 0x7FFF : 1)) {
        if (w > 0x7FFF && w < 0xFF80) continue;
        std::size_t const col = x.size() % static_cast<std::size_t>(k);
        std::size_t const fill = std::min<std::size_t>(128 - col % 128, static_cast<std::size_t>(k) - col);
        for (std::size_t f = 0; f < fill; ++f)
          x.push_back(f == fill / 2 ? bf(static_cast<std::uint16_t>(w)) : bf(static_cast<std::uint16_t>(anchor - (f % 7))));
        if (w == 0xFFFF) break;
      }
      while (x.size() % static_cast<std::size_t>(k)) x.push_back(bf(static_cast<std::uint16_t>(0x8000 | (x.size() % 3))));
      index_t const m = static_cast<index_t>(x.size()) / k;
      auto const ref = run(ser, x, m, k, tile_1x128, fmt);
      auto const vec = run(thr, x, m, k, tile_1x128, fmt);
      CAPTURE(a);
      CAPTURE(static_cast<int>(fmt));
      std::size_t bad = 0, first = ref.q.size();
      for (std::size_t i = 0; i < ref.q.size(); ++i)
        if (ref.q[i] != vec.q[i] && bad++ == 0) first = i;
      CAPTURE(first);
      CHECK(bad == 0);
      CHECK(same_bits(ref.s, vec.s));
    }
    // every amax pattern: tile t holds pattern t and 127 smaller magnitudes of either sign
    std::vector<bfloat16> x(static_cast<std::size_t>(0x10000) * 128);
    for (std::uint32_t t = 0; t < 0x10000u; ++t)
      for (std::uint32_t j = 0; j < 128; ++j)
        x[t * 128 + j] = bf(static_cast<std::uint16_t>(j == 0 ? t : ((t & 0x7FFF) >= 0x7F80 ? 0x3F80 : (t & 0x7FFF) * (j % 5) / 5) | ((j & 1) << 15)));
    index_t const kk = 128 * 8, m = 0x10000 * 128 / kk;
    auto const ref = run(ser, x, m, kk, tile_1x128, fmt);
    auto const vec = run(thr, x, m, kk, tile_1x128, fmt);
    CHECK(ref.q == vec.q);
    CHECK(same_bits(ref.s, vec.s));
  }
}

TEST_CASE("fp8 tiles: tiles holding zeros, vector 1x128 path against the reference") {
  // The vector path's subnormal-code test reads min(2|x|), which is 0 for any tile holding a ±0;
  // such tiles are judged on their smallest nonzero |x| instead. Each tile: amax a = 1 (or the
  // sign-flipped), zeros of both signs, and a smallest nonzero value placed just below, at and
  // just above the E4M3-subnormal boundary y = 2^-6 (x = 2^-6 · s, s = 1/448), or far from it;
  // plus all-+0, all--0, mixed-sign all-zero tiles and a lone nonzero among zeros.
  cpu::serial ser;
  cpu::threads<> thr(2);
  auto const bf = [](std::uint16_t u) { return k3::detail::bit_cast<bfloat16>(u); };
  auto const bits_of = [](float f) { return static_cast<std::uint16_t>(k3::detail::bit_cast<std::uint32_t>(f) >> 16); };
  std::uint16_t const edge = bits_of(0x1p-6f / 448.0f);
  std::vector<std::uint16_t> smallest = {static_cast<std::uint16_t>(edge - 2), static_cast<std::uint16_t>(edge - 1), edge,
                                         static_cast<std::uint16_t>(edge + 1), static_cast<std::uint16_t>(edge + 2), bits_of(1e-30f),
                                         bits_of(0.25f), 0x0001};
  index_t const k = 128 * 5;
  std::vector<bfloat16> x;
  for (std::uint16_t sm : smallest)
    for (int zeros : {1, 5, 126}) {
      for (int j = 0; j < 128; ++j) {
        std::uint16_t v = bits_of(0.5f + static_cast<float>(j % 9) / 32.0f);
        if (j == 3) v = bits_of(1.0f);
        else if (j == 7) v = sm;
        else if (j >= 8 && j < 8 + zeros) v = j % 2 ? 0x8000 : 0x0000;
        if (zeros == 126 && j != 3 && j != 7) v = j % 2 ? 0x8000 : 0x0000;
        x.push_back(bf(static_cast<std::uint16_t>(v | (j % 3 == 0 ? 0x8000 : 0))));
      }
    }
  for (std::uint16_t z : {std::uint16_t{0x0000}, std::uint16_t{0x8000}})
    for (int j = 0; j < 128; ++j) x.push_back(bf(z));
  for (int j = 0; j < 128; ++j) x.push_back(bf(static_cast<std::uint16_t>(j % 2 ? 0x8000 : 0)));
  for (std::uint16_t lone : {std::uint16_t{0x0001}, edge, bits_of(3.0f), std::uint16_t{0x7FC0}})
    for (int j = 0; j < 128; ++j) x.push_back(bf(static_cast<std::uint16_t>(j == 77 ? lone : (j % 2 ? 0x8000 : 0))));
  while (x.size() % static_cast<std::size_t>(k)) x.push_back(bf(0x8000));
  index_t const m = static_cast<index_t>(x.size()) / k;
  for (scale_format fmt : {scale_format::fp32, scale_format::ue8m0}) {
    CAPTURE(static_cast<int>(fmt));
    auto const ref = run(ser, x, m, k, tile_1x128, fmt);
    auto const vec = run(thr, x, m, k, tile_1x128, fmt);
    CHECK(ref.q == vec.q);
    CHECK(same_bits(ref.s, vec.s));
  }
}

TEST_CASE("fp8 re-quantisation 1x128 -> 128x1") {
  cpu::threads<> thr(2);
  for (scale_format fmt : {scale_format::fp32, scale_format::ue8m0}) {
    index_t const m = 200, k = 300;
    auto x = qt::random_matrix(m, k, 5, 3.0f);
    auto a = run(thr, x, m, k, tile_1x128, fmt);
    std::vector<std::uint8_t> q2(m * k);
    std::vector<float> s2(2 * k);
    fp8_requantize_1x128_to_128x1(thr,
                                  fp8_requantize_args<>{.q = host_view(a.q.data(), m, k),
                                                        .scales = host_view(a.s.data(), m, 3),
                                                        .q2 = host_view(q2.data(), m, k),
                                                        .scales2 = host_view(s2.data(), 2, k)},
                                  {.format = fmt});
    // equals quantising the dequantised tensor in 128x1 tiles
    std::vector<float> y(m * k);
    fp8_dequantize(
        thr, fp8_dequantize_args<float>{.q = host_view(a.q.data(), m, k), .scales = host_view(a.s.data(), m, 3), .y = host_view(y.data(), m, k)});
    auto b = run(cpu::serial{}, y, m, k, tile_128x1, fmt);
    CHECK(b.q == q2);
    CHECK(same_bits(b.s, s2));
    if (fmt == scale_format::ue8m0) {
      // power-of-two scales: every element that stays a normal E4M3 number is re-quantised exactly
      long normal = 0, exact = 0;
      for (index_t i = 0; i < m; ++i)
        for (index_t j = 0; j < k; ++j) {
          float const v = decode<e4m3_format>(q2[i * k + j]);
          if (std::fabs(y[i * k + j] / s2[(i / 128) * k + j]) < 0x1p-6f) continue;  // lands in the subnormal range
          ++normal;
          exact += v * s2[(i / 128) * k + j] == y[i * k + j];
        }
      CHECK(normal > m * k / 2);
      CHECK(exact == normal);
    }
  }
}

TEST_CASE("fp8 tiles: bad arguments") {
  std::vector<float> x(4 * 256);
  std::vector<std::uint8_t> q(4 * 256);
  std::vector<float> s(8);
  cpu::serial ser;
  auto xv = host_view(x.data(), 4, 256);
  auto qv = host_view(q.data(), 4, 256);
  CHECK_NOTHROW(fp8_quantize(ser, fp8_quantize_args<float>{.x = xv, .q = qv, .scales = host_view(s.data(), 4, 2)}));
  CHECK_THROWS_AS(fp8_quantize(ser, fp8_quantize_args<float>{.x = xv, .q = qv, .scales = host_view(s.data(), 4, 1)}),
                  k3::error);  // scales of the wrong shape
  CHECK_THROWS_AS(fp8_quantize(ser, fp8_quantize_args<float>{.x = xv, .q = qv, .scales = host_view(s.data(), 2, 2)}, {.tile = tile_128x128}),
                  k3::error);
  CHECK_THROWS_AS(fp8_quantize(ser, fp8_quantize_args<float>{.x = xv, .q = host_view(q.data(), 4, 255), .scales = host_view(s.data(), 4, 2)}),
                  k3::error);
  CHECK_THROWS_AS(fp8_quantize(ser, fp8_quantize_args<float>{.x = xv, .q = qv, .scales = host_view(s.data(), 4, 2)}, {.tile = tile{0, 128}}),
                  k3::error);
  auto* xb = reinterpret_cast<std::uint8_t*>(x.data());  // q aliasing x
  CHECK_THROWS_AS(fp8_quantize(ser, fp8_quantize_args<float>{.x = xv, .q = host_view(xb, 4, 256), .scales = host_view(s.data(), 4, 2)}), k3::error);
  try {
    fp8_quantize(ser, fp8_quantize_args<float>{.x = xv, .q = qv, .scales = host_view(s.data(), 4, 1)});
  } catch (k3::error const& e) {
    std::string w = e.what();
    CHECK(w.find("'scales'") != std::string::npos);
    CHECK(w.find("[4, 2]") != std::string::npos);
  }
  // empty inputs are fine
  CHECK_NOTHROW(fp8_quantize(
      ser, fp8_quantize_args<float>{.x = host_view(x.data(), 0, 256), .q = host_view(q.data(), 0, 256), .scales = host_view(s.data(), 0, 2)}));
}
