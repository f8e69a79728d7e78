// k3/moe/threads.hpp — the router on k3::cpu::threads<Arch>: one pass over each token's
// scores does the top-(k+1) selection (SIMD threshold filter + a small sorted buffer), then,
// while the row is still in L1, scatters its margins into the calling thread's private
// histogram. Per-thread histograms (int32, exact) are summed into the int64 result at the end,
// so the counts are bit-identical to the serial reference whatever the thread count.
//
// Results are identical to route_serial (same float operations, same tie-breaking: lower
// expert index wins on equal biased score). Group-limited routing and logit input use the
// reference per-token routine inside the threaded loop.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>
#include <xsimd/xsimd.hpp>

#include "k3/backend/cpu/simd.hpp"
#include "k3/moe/quantile_balancing.hpp"
#include "k3/moe/router.hpp"

namespace k3::moe::detail {

// Top-(k+1) of z = s + b for one token, ranking order. Scans experts in increasing index, so an
// incoming expert ties-loses against everything already held: strictly-greater inserts only.
// Returns false if the row holds a non-finite score.
template <class Arch>
bool select_token_simd(float const* K3_RESTRICT s, float const* K3_RESTRICT b, index_t n, index_t kk, ranked* best) {
  using batch = xsimd::batch<float, Arch>;
  constexpr index_t W = static_cast<index_t>(batch::size);
  // Seed with the first kk experts, insertion-sorted.
  index_t filled = 0;
  auto insert = [&](float z, std::int32_t j) {
    index_t p = filled < kk ? filled++ : kk - 1;
    while (p > 0 && ranks_before(z, j, best[p - 1].z, best[p - 1].j)) {
      best[p] = best[p - 1];
      --p;
    }
    best[p] = {z, j};
  };
  bool finite = true;
  index_t j = 0;
  for (; j < kk; ++j) {
    finite &= std::isfinite(s[j]);
    insert(s[j] + b[j], static_cast<std::int32_t>(j));
  }
  auto const inf = batch(std::numeric_limits<float>::infinity());
  auto bad = xsimd::batch_bool<float, Arch>(false);
  for (; j + W <= n; j += W) {
    batch sv = batch::load_unaligned(s + j);
    batch z = sv + batch::load_unaligned(b + j);
    bad = bad | !(xsimd::abs(sv) < inf);
    auto hit = z > batch(best[kk - 1].z);
    if (xsimd::any(hit)) {
      alignas(64) float zz[W];
      z.store_aligned(zz);
      for (index_t l = 0; l < W; ++l)
        if (zz[l] > best[kk - 1].z) insert(zz[l], static_cast<std::int32_t>(j + l));
    }
  }
  for (; j < n; ++j) {
    finite &= std::isfinite(s[j]);
    float z = s[j] + b[j];
    if (z > best[kk - 1].z) insert(z, static_cast<std::int32_t>(j));
  }
  return finite && !xsimd::any(bad);
}

// Adds one token's margins alpha - s_j to a private int32 histogram [n][B].
template <class Arch>
void scatter_token_simd(float const* K3_RESTRICT s, float alpha, index_t n, float lo, float inv_w, std::int32_t B,
                        std::int32_t* K3_RESTRICT h) {
  using batch = xsimd::batch<float, Arch>;
  using ibatch = xsimd::batch<std::int32_t, Arch>;
  constexpr index_t W = static_cast<index_t>(batch::size);
  index_t j = 0;
  if (n >= W) {
    alignas(64) std::int32_t off0[W];
    for (index_t l = 0; l < W; ++l) off0[l] = static_cast<std::int32_t>(l) * B;
    ibatch off = ibatch::load_aligned(off0);
    ibatch const step(static_cast<std::int32_t>(W) * B);
    batch const va(alpha), vlo(lo), vinv(inv_w), vmax(float(B - 1)), zero(0.f);
    alignas(64) std::int32_t idx[W];
    for (; j + W <= n; j += W) {
      batch r = va - batch::load_unaligned(s + j);
      batch t = xsimd::floor((r - vlo) * vinv);
      t = xsimd::min(xsimd::max(t, zero), vmax);
      ibatch bin = xsimd::batch_cast<std::int32_t>(t) + off;
      bin.store_aligned(idx);
      for (index_t l = 0; l < W; ++l) ++h[idx[l]];
      off += step;
    }
  }
  for (; j < n; ++j) ++h[j * B + qb_bin(alpha - s[j], lo, inv_w, B)];
}

template <class Arch>
void route_threads_impl(cpu::threads<Arch> const& backend, const_view<float, 2> scores, const_view<float, 1> bias,
                        route_outputs const& out, router_options const& opt, const_view<std::uint8_t, 1> mask, qb_histogram* hist) {
  index_t const m = scores.extent(0), n = scores.extent(1), kk = opt.k + 1;
  bool const fast = opt.n_groups == 1 && opt.input == score_kind::scores;
  // Contiguous copy of the bias for the SIMD path (the view may be strided).
  std::vector<float> bvec(static_cast<std::size_t>(n));
  for (index_t j = 0; j < n; ++j) bvec[j] = bias(j);
  std::int64_t const parts = std::min<std::int64_t>(m, backend.concurrency());
  std::int32_t const B = hist ? static_cast<std::int32_t>(hist->bins()) : 0;
  std::vector<std::vector<std::int32_t>> local_h(static_cast<std::size_t>(hist ? parts : 0));
  std::vector<std::vector<std::int64_t>> local_load(static_cast<std::size_t>(out.load.empty() ? 0 : parts));
  std::vector<index_t> bad_token(static_cast<std::size_t>(parts), -1);
  backend.for_each_task(parts, [&](std::int64_t p) {
    index_t const lo_i = m * p / parts, hi_i = m * (p + 1) / parts;
    std::int32_t* h = nullptr;
    if (hist) {
      local_h[p].assign(static_cast<std::size_t>(n * B), 0);
      h = local_h[p].data();
    }
    std::int64_t* ld = nullptr;
    if (!out.load.empty()) {
      local_load[p].assign(static_cast<std::size_t>(n), 0);
      ld = local_load[p].data();
    }
    std::vector<ranked> best(static_cast<std::size_t>(kk)), z;
    std::vector<float> srow(static_cast<std::size_t>(n));
    for (index_t i = lo_i; i < hi_i; ++i) {
      float const* s = &scores(i, 0);
      if (fast) {
        if (!select_token_simd<Arch>(s, bvec.data(), n, kk, best.data())) {
          bad_token[p] = i;
          return;
        }
      } else {
        for (index_t j = 0; j < n; ++j) {
          if (!std::isfinite(s[j])) {
            bad_token[p] = i;
            return;
          }
          srow[j] = load_score(s[j], opt.input);
        }
        s = srow.data();
      }
      if (!mask.empty() && mask(i) == 0) {
        emit_padding(i, opt, out);
        continue;
      }
      if (!fast) rank_token(s, bias, opt, n, z, best);
      emit_token(i, s, best.data(), opt, out);
      if (ld)
        for (index_t r = 0; r < opt.k; ++r) ++ld[best[r].j];
      if (h) scatter_token_simd<Arch>(s, best[opt.k].z, n, hist->lo(), hist->inv_width(), B, h);
    }
  });
  for (std::int64_t p = 0; p < parts; ++p)
    if (bad_token[p] >= 0) {
      index_t i = bad_token[p];
      for (index_t j = 0; j < n; ++j)
        if (!std::isfinite(scores(i, j))) throw k3::error(nonfinite_message(i, j, opt.input));
    }
  if (!out.load.empty())
    for (index_t j = 0; j < n; ++j) {
      std::int64_t c = 0;
      for (std::int64_t p = 0; p < parts; ++p) c += local_load[p][j];
      out.load(j) = c;
    }
  if (hist) {
    std::int64_t* H = hist->data();
    std::int64_t const total = n * B;
    std::int64_t const chunks = std::min<std::int64_t>(total, 4 * backend.concurrency());
    backend.for_each_task(chunks, [&](std::int64_t c) {
      std::int64_t a = total * c / chunks, e = total * (c + 1) / chunks;
      for (std::int64_t p = 0; p < parts; ++p) {
        std::int32_t const* src = local_h[p].data();
        for (std::int64_t x = a; x < e; ++x) H[x] += src[x];
      }
    });
  }
}

}  // namespace k3::moe::detail
