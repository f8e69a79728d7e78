// k3/moe/threads.hpp — the router on k3::cpu::threads<Arch>: one pass over each token's
// scores does the top-(k+1) selection (SIMD threshold filter + a small sorted buffer), then,
// while the row is still in L1, scatters its margins into the calling thread's private
// histogram. Per-thread histograms (integer, exact) are summed into the int64 result at the end,
// so the counts are bit-identical to the serial reference whatever the thread count.
//
// Results are identical to route_serial (same float operations, same tie-breaking: lower
// expert index wins on equal biased score). Group-limited routing and logit input use the
// reference per-token routine inside the threaded loop.
#pragma once
#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <type_traits>
#include <cstdint>
#include <limits>
#include <memory>
#include <vector>
#include <xsimd/xsimd.hpp>

#include "k3/backend/cpu/simd.hpp"
#include "k3/core/arch/target.hpp"
#include "k3/core/prefetch.hpp"
#include "k3/moe/arch/avx512.hpp"
#include "k3/moe/arch/generic.hpp"
#include "k3/moe/arch/sse_avx.hpp"
#include "k3/moe/arch/x86_64.hpp"
#include "k3/moe/quantile_balancing.hpp"
#include "k3/moe/router.hpp"

namespace k3::moe::detail {

// Top-(k+1) of z = s + b for one token, in ranking order, by a guessed threshold g carried
// from token to token: one SIMD pass collects the candidates z >= g (in index order). If at
// least k+1 qualify, the k+1 best overall are among them (anything below g has k+1 candidates
// ranked before it), so a stable sort of the few candidates finishes the job; otherwise the
// exact insertion filter runs as a fallback. Either way the result is the exact top-(k+1) with
// the documented tie-breaking; g only affects speed. g is then set to the biased score of rank
// 2 (k+1) so that the next token usually has a few more than k+1 candidates.
// Bit l set iff lane l of b is true (xsimd 8.1 has no batch_bool::mask(); the ISA forms are in
// k3/moe/arch/).
template <class Arch>
inline std::uint64_t lane_mask(xsimd::batch_bool<float, Arch> const& b) noexcept {
  return kernel::lane_mask(b, Arch{});
}

struct select_state {
  float guess = -std::numeric_limits<float>::infinity();
  float spread = 0.f;
  std::vector<ranked> cand;
  std::vector<float> cz;          // candidate biased scores (index order), padded with -inf
  std::vector<std::int32_t> cj;   // their expert ids
};

// Exact insertion filter for the `keep` best (ranking order), scanning experts in increasing
// index: an incoming expert loses ties against everything held, so strictly-greater inserts.
template <class Arch>
void insertion_filter(float const* K3_RESTRICT s, float const* K3_RESTRICT b, index_t n, index_t keep, ranked* best) {
  using batch = xsimd::batch<float, Arch>;
  constexpr index_t W = static_cast<index_t>(batch::size);
  index_t filled = 0;
  auto insert = [&](float z, std::int32_t j) {
    index_t p = filled < keep ? filled++ : keep - 1;
    while (p > 0 && ranks_before(z, j, best[p - 1].z, best[p - 1].j)) {
      best[p] = best[p - 1];
      --p;
    }
    best[p] = {z, j};
  };
  index_t j = 0;
  for (; j < keep; ++j) insert(s[j] + b[j], static_cast<std::int32_t>(j));
  for (; j + W <= n; j += W) {
    batch z = batch::load_unaligned(s + j) + batch::load_unaligned(b + j);
    if (xsimd::any(z > batch(best[keep - 1].z))) {
      alignas(64) float zz[W];
      z.store_aligned(zz);
      for (index_t l = 0; l < W; ++l)
        if (zz[l] > best[keep - 1].z) insert(zz[l], static_cast<std::int32_t>(j + l));
    }
  }
  for (; j < n; ++j) {
    float z = s[j] + b[j];
    if (z > best[keep - 1].z) insert(z, static_cast<std::int32_t>(j));
  }
}

// Returns false if the row holds a non-finite score.
template <class Arch>
bool select_token_simd(float const* K3_RESTRICT s, float const* K3_RESTRICT b, index_t n, index_t kk, ranked* best, select_state& st) {
  using batch = xsimd::batch<float, Arch>;
  constexpr index_t W = static_cast<index_t>(batch::size);
  index_t const target = std::min<index_t>(n - 1, 2 * kk);  // rank whose score becomes the next guess
  auto& cand = st.cand;
  cand.resize(static_cast<std::size_t>(n));
  st.cz.resize(static_cast<std::size_t>(n + 2 * W));
  st.cj.resize(static_cast<std::size_t>(n + 2 * W));
  float* K3_RESTRICT cz = st.cz.data();
  std::int32_t* K3_RESTRICT cj = st.cj.data();
  // Candidates z >= g in index order; also checks finiteness (first pass only).
  auto collect = [&](float g, bool check, bool& ok) {
    auto const inf = batch(std::numeric_limits<float>::infinity());
    auto bad = xsimd::batch_bool<float, Arch>(false);
    bool finite = true;
    index_t c = 0;
    batch const vg(g);
    index_t j = 0;
    for (; j + W <= n; j += W) {
      batch sv = batch::load_unaligned(s + j);
      batch z = sv + batch::load_unaligned(b + j);
      if (check) bad = bad | !(xsimd::abs(sv) < inf);
      if (kernel::route_kernels<Arch>::compress_candidates(z, vg, j, cz, cj, c)) continue;
      if (std::uint64_t mk = lane_mask<Arch>(z >= vg)) {
        alignas(64) float zz[W];
        z.store_aligned(zz);
        do {
          int const l = std::countr_zero(mk);
          mk &= mk - 1;
          cz[c] = zz[l];
          cj[c++] = static_cast<std::int32_t>(j + l);
        } while (mk);
      }
    }
    for (; j < n; ++j) {
      if (check) finite &= std::isfinite(s[j]);
      float z = s[j] + b[j];
      if (z >= g) {
        cz[c] = z;
        cj[c++] = static_cast<std::int32_t>(j);
      }
    }
    ok = finite && !xsimd::any(bad);
    return c;
  };
  bool ok = true;
  index_t c = collect(st.guess, true, ok);
  if (!ok) return false;
  // Too few: lower the guess by the typical spread between rank 0 and rank `target`, doubling.
  float step = st.spread;
  for (int tries = 0; c < kk && tries < 3 && step > 0.f; ++tries, step *= 2.f) c = collect(st.guess - step, false, ok);
  if (c < kk) {  // exact filter for the target+1 best, which also refreshes the guess
    insertion_filter<Arch>(s, b, n, target + 1, cand.data());
    std::copy(cand.begin(), cand.begin() + kk, best);
    st.guess = cand[target].z;
    st.spread = cand[0].z - cand[target].z;
    return true;
  }
  if (c <= 64) {
    // Branchless ranking: rank(a) = #{b : z_b > z_a} + #{b < a : z_b == z_a} (candidates are in
    // index order, so b < a means a lower expert id). Ranks are distinct, so each candidate
    // lands in its slot directly.
    for (index_t x = c; x < c + W; ++x) cz[x] = -std::numeric_limits<float>::infinity();
    for (index_t a = 0; a < c; ++a) {
      batch const za(cz[a]);
      index_t rank = 0;
      for (index_t o = 0; o < c; o += W) {
        batch v = batch::load_unaligned(cz + o);
        std::uint64_t gt = lane_mask<Arch>(v > za), eq = lane_mask<Arch>(v == za);
        index_t const below = std::clamp<index_t>(a - o, 0, W);  // lanes with b < a
        std::uint64_t const low = below >= 64 ? ~std::uint64_t(0) : (std::uint64_t(1) << below) - 1;
        rank += std::popcount(gt) + std::popcount(eq & low);
      }
      if (rank < kk) best[rank] = {cz[a], cj[a]};
      if (rank == target) st.guess = cz[a];
    }
    if (c > target) st.spread = 0.75f * st.spread + 0.25f * (best[0].z - st.guess);
    return true;
  }
  auto cmp = [](ranked const& x, ranked const& y) { return ranks_before(x.z, x.j, y.z, y.j); };
  index_t const need = std::min(c, target + 1);
  for (index_t a = 0; a < c; ++a) cand[a] = {cz[a], cj[a]};
  std::partial_sort(cand.begin(), cand.begin() + need, cand.begin() + c, cmp);
  std::copy(cand.begin(), cand.begin() + kk, best);
  if (c > target) {
    st.guess = cand[target].z;
    st.spread = 0.75f * st.spread + 0.25f * (cand[0].z - cand[target].z);
  }
  return true;
}


// qb_bin for the W margins alpha - s[0..W) (va = alpha, vlo = lo, vinv = inv_w, vmax = B - 1
// broadcast): the same operations per lane, so the same bins.
template <class Arch>
K3_INLINE xsimd::batch<std::int32_t, Arch> qb_bin_batch(float const* s, xsimd::batch<float, Arch> va, xsimd::batch<float, Arch> vlo,
                                                        xsimd::batch<float, Arch> vinv, xsimd::batch<float, Arch> vmax) noexcept {
  using batch = xsimd::batch<float, Arch>;
  batch const r = va - batch::load_unaligned(s);
  batch const t = xsimd::floor((r - vlo) * vinv);
  return xsimd::batch_cast<std::int32_t>(xsimd::min(xsimd::max(t, batch(0.f)), vmax));
}

// The private per-thread counts are 8-bit (an expert's row of 1000 bins is 16 cache lines, the
// K3 histogram 0.9 MB: it stays in L2 next to the streamed scores, and each block's visit of a
// row moves half the lines of 16-bit counts). A count that wraps to 0 has gained 256: its index
// is appended to the thread's carry list, added back in the merge. Wraps are rare (one per 256
// increments of one bin) and the branch is not taken otherwise.
// One per thread, each on its own cache lines: `used` is written after every expert group of
// the scatter, and two threads' lists sharing a line cost a cross-core miss each time, enough
// to show in the scatter's time (benchmarks/moe.md).
struct alignas(64) count_carries {
  std::vector<std::size_t> at;
  std::size_t used = 0;
  // Room for `more` further carries; the scatter loops write through a plain pointer (a call
  // inside them would make the compiler keep their state on the stack).
  std::size_t* reserve(std::size_t more) {
    if (at.size() - used < more) at.resize(std::max(2 * at.size(), used + more));
    return at.data() + used;
  }
};

// One 8-bit count up; a wrap to 0 appends the count's index to the carries (k3/moe/arch/).
K3_INLINE void bump(std::uint8_t* K3_RESTRICT row, std::size_t row_at, std::size_t bin, std::size_t*& carry) {
  kernel::bump(row, row_at, bin, carry, ::k3::detail::target::tag{});
}

// Adds one token's margins alpha - s_j to the private 8-bit histogram [n][B] (the path for
// B > 65536, whose bins do not fit the 16-bit block buffer).
template <class Arch>
void scatter_token_simd(float const* K3_RESTRICT s, float alpha, index_t n, float lo, float inv_w, std::int32_t B,
                        std::uint8_t* K3_RESTRICT h, count_carries& carries) {
  using batch = xsimd::batch<float, Arch>;
  constexpr index_t W = static_cast<index_t>(batch::size);
  index_t j = 0;
  batch const va(alpha), vlo(lo), vinv(inv_w), vmax(float(B - 1));
  alignas(64) std::int32_t idx[W];
  std::size_t* const c0 = carries.reserve(static_cast<std::size_t>(n));
  std::size_t* c = c0;
  for (; j + W <= n; j += W) {
    qb_bin_batch<Arch>(s + j, va, vlo, vinv, vmax).store_aligned(idx);
    for (index_t l = 0; l < W; ++l) {
      std::size_t const at = static_cast<std::size_t>(j + l) * static_cast<std::size_t>(B);
      bump(h + at, at, static_cast<std::size_t>(idx[l]), c);
    }
  }
  for (; j < n; ++j) {
    std::size_t const at = static_cast<std::size_t>(j) * static_cast<std::size_t>(B);
    bump(h + at, at, static_cast<std::size_t>(qb_bin(alpha - s[j], lo, inv_w, B)), c);
  }
  carries.used += static_cast<std::size_t>(c - c0);
}

// The AVX-512 binning packs two 16-lane vectors of bins with one vpackusdw, which interleaves
// them per 128-bit lane: of each 32 experts, the groups of four land in the order
// 0, 4, 1, 5, 2, 6, 3, 7 (group g of the first vector at 8g, of the second at 8g + 4). The
// experts past the last whole 32 keep their places. The scatter reads group j at its slot.
template <class Arch>
inline constexpr bool paired_bins = kernel::route_kernels<Arch>::paired_bins;

inline index_t paired_slot(index_t j) noexcept {
  index_t const r = j & 31;
  return (j & ~index_t(31)) | ((r & 12) << 1) | ((r & 16) >> 2);
}

// Bins of one token's margins (row-major block buffer, B <= 65536). Scattering a block of
// tokens expert by expert afterwards keeps each expert's histogram row in L1 while its
// increments land, instead of touching n different rows per token.
template <class Arch>
void bin_token_simd(float const* K3_RESTRICT s, float alpha, index_t n, float lo, float inv_w, std::int32_t B,
                    std::uint16_t* K3_RESTRICT out) {
  using batch = xsimd::batch<float, Arch>;
  constexpr index_t W = static_cast<index_t>(batch::size);
  index_t j = 0;
  batch const va(alpha), vlo(lo), vinv(inv_w), vmax(float(B - 1));
  alignas(64) std::int32_t idx[W];
  if constexpr (paired_bins<Arch>) j = kernel::route_kernels<Arch>::bin_pairs(s, alpha, n, lo, inv_w, B, out);
  for (; j + W <= n; j += W) {
    auto const ib = qb_bin_batch<Arch>(s + j, va, vlo, vinv, vmax);
    if (kernel::route_kernels<Arch>::store_bins(ib, out + j)) continue;
    ib.store_aligned(idx);
    for (index_t l = 0; l < W; ++l) out[j + l] = static_cast<std::uint16_t>(idx[l]);
  }
  for (; j < n; ++j) out[j] = static_cast<std::uint16_t>(qb_bin(alpha - s[j], lo, inv_w, B));
}

// Bins of `tokens` tokens (row t at bins + t * ld) land expert by expert, four experts per
// pass (four rows in flight; one 16-bit load per increment, no shifts). `paired`: the rows
// were written by the paired AVX-512 binning (see paired_slot).
inline void scatter_block(std::uint16_t const* K3_RESTRICT bins, index_t tokens, index_t n, index_t ld, std::int32_t B,
                          std::uint8_t* K3_RESTRICT h, count_carries& carries, k3::detail::rows_ahead& ahead, bool paired) {
  std::size_t const row = static_cast<std::size_t>(B);
  index_t const n_paired = paired ? n & ~index_t(31) : 0;
  index_t j = 0;
  for (; j + 4 <= n; j += 4) {
    ahead.step();
    index_t const slot = j < n_paired ? paired_slot(j) : j;
    std::size_t const at = static_cast<std::size_t>(j) * row;
    std::uint8_t* K3_RESTRICT r0 = h + at;
    std::uint8_t* K3_RESTRICT r1 = r0 + row;
    std::uint8_t* K3_RESTRICT r2 = r1 + row;
    std::uint8_t* K3_RESTRICT r3 = r2 + row;
    std::size_t* const c0 = carries.reserve(4 * static_cast<std::size_t>(tokens));
    std::size_t* c = c0;
    for (index_t t = 0; t < tokens; ++t) {
      std::uint16_t const* b = bins + t * ld + slot;
      bump(r0, at, b[0], c);
      bump(r1, at + row, b[1], c);
      bump(r2, at + 2 * row, b[2], c);
      bump(r3, at + 3 * row, b[3], c);
    }
    carries.used += static_cast<std::size_t>(c - c0);
  }
  for (; j < n; ++j) {
    std::size_t const at = static_cast<std::size_t>(j) * row;
    std::size_t* const c0 = carries.reserve(static_cast<std::size_t>(tokens));
    std::size_t* c = c0;
    for (index_t t = 0; t < tokens; ++t) bump(h + at, at, bins[t * ld + j], c);
    carries.used += static_cast<std::size_t>(c - c0);
  }
}

// H[x] += the sum of the threads' private 8-bit counts parts[p][x], x in [a, e). Lines of
// eight counts that sum to 0 are neither read nor written: about half of the K3 histogram's
// 7 MB of int64 counts, since a token's margins alpha - s_j span only (alpha - 1, alpha) of
// the range [min(b) - 1, max(b) + 1]. `fresh`: H is known to be 0, so it is written without
// being read, with non-temporal stores where whole lines can be: no read for ownership of the
// lines it overwrites (benchmarks/moe.md).
template <class Arch>
void merge_counts(std::int64_t* K3_RESTRICT H, std::uint8_t const* const* parts, std::int64_t P, std::int64_t a,
                         std::int64_t e, bool fresh) {
  auto one = [&](std::int64_t x) {
    std::int64_t v = 0;
    for (std::int64_t p = 0; p < P; ++p) v += parts[p][x];
    if (v != 0) H[x] = fresh ? v : H[x] + v;
  };
  std::int64_t x = a;
  x = kernel::route_kernels<Arch>::merge_lines(H, parts, P, x, e, fresh);
  for (; x < e; ++x) one(x);
}

// Row stride (uint16 elements) of the block buffer: a whole number of cache lines, odd, so that
// the lines that one expert's loads touch in a chunk spread over every L1 set (with n = 896 the plain
// stride of 28 lines maps a chunk's 64 tokens onto 16 sets and thrashes).
inline index_t block_stride(index_t n) {
  index_t lines = (n + 31) / 32;
  return 32 * (lines | 1);
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
  // Private per-thread counts: 8-bit, with a list of carries (see count_carries).
  std::vector<std::vector<std::uint8_t>*> local_h(static_cast<std::size_t>(hist ? parts : 0));
  if (hist) {
    hist->scratch(static_cast<std::size_t>(parts - 1));  // grow once: later calls must not reallocate
    for (std::int64_t p = 0; p < parts; ++p) local_h[p] = &hist->scratch(static_cast<std::size_t>(p));
  }
  std::vector<count_carries> carries(static_cast<std::size_t>(hist ? parts : 0));
  // Per-thread expert loads, one row per thread padded to whole cache lines (no line shared
  // between two threads' increments).
  std::size_t const load_ld = (static_cast<std::size_t>(n) + 7) & ~std::size_t(7);
  std::vector<std::int64_t, xsimd::aligned_allocator<std::int64_t, 64>> local_load(out.load.empty() ? 0 : static_cast<std::size_t>(parts) * load_ld, 0);
  std::vector<index_t> bad_token(static_cast<std::size_t>(parts), -1);
  // Tokens go to the threads in chunks of up to 64, taken in increasing order from a shared
  // counter (one 229 KB stretch of K3 scores each): a thread that starts late or loses its core
  // for a while (a busy machine, the worker's wake-up) no longer leaves the other waiting at the
  // end with half of the tokens. Which thread routes a token changes only speed (the selection
  // is exact, the counts are integers).
  index_t const chunk = std::clamp<index_t>(m / (4 * parts), 1, 64);
  std::atomic<index_t> next_chunk{0};
  std::atomic<bool> failed{false};
  backend.for_each_task(parts, [&](std::int64_t p) {
    std::uint8_t* h = nullptr;
    // A chunk's bins are scattered together: each expert's row (16 lines of 8-bit counts) gets
    // up to 64 increments per visit, while the lines of the bin buffer that one group of 32
    // experts reads stay in L1.
    bool const blocked = B <= 65536;
    index_t const bin_ld = block_stride(n);
    std::vector<std::uint16_t> bins(static_cast<std::size_t>(blocked && hist ? chunk * bin_ld : 0));
    index_t in_block = 0;
    if (hist) {
      local_h[p]->assign(static_cast<std::size_t>(n * B), 0);  // keeps capacity: no page faults after the first call
      h = local_h[p]->data();
    }
    std::int64_t* ld = nullptr;
    if (!out.load.empty()) {
      ld = local_load.data() + static_cast<std::size_t>(p) * load_ld;
    }
    std::vector<ranked> best(static_cast<std::size_t>(kk)), z;
    select_state st;
    using RK = kernel::route_kernels<Arch>;
    bool const select512 = RK::fast_select && fast && kk <= 49;  // the ISA file's selection (AVX-512)
    auto st512 = select512 ? std::make_unique<typename RK::select_state>() : nullptr;
    std::vector<float> srow(static_cast<std::size_t>(n));
    bool const contiguous = out.indices.stride(1) == 1 && out.weights.stride(1) == 1;
    // A non-finite score stops this thread (and, at their next chunk, the others); chunks are
    // handed out in order and a chunk once taken is finished, so the smallest token recorded
    // is the first bad token overall, whatever the thread count.
    // With a histogram, each chunk's tokens are binned as they are routed and scattered at the
    // chunk's end, and the next chunk is claimed one chunk early so that its rows can be
    // prefetched while this one is worked on. A claimed chunk is routed even after another
    // thread failed (only this thread's own bad token stops it, and that one precedes its claim).
    auto claim = [&] { return failed.load(std::memory_order_relaxed) ? m : next_chunk.fetch_add(1, std::memory_order_relaxed); };
    for (index_t c = claim(), c_next; c * chunk < m; c = c_next) {
      c_next = claim();
      index_t const c1 = std::min(m, (c + 1) * chunk);
      // The next chunk's rows (blocked histogram only). With the AVX-512 selection, a quarter
      // of a row's worth of its lines goes out during each token's candidate pass (one line per
      // 64 scores) and a seventh after its binning; the scatter spreads the rest over its expert
      // groups. The whole stream in the scatter stalls it on its own L2 traffic, and denser
      // spreads (two lines per 64 scores, a line per ranked candidate as well, or more lines
      // after the binning) were slower (benchmarks/moe.md).
      bool const chunk_stream = h != nullptr && blocked;
      index_t const next0 = std::min(m, c_next * chunk), next1 = std::min(m, (c_next + 1) * chunk);
      k3::detail::rows_ahead chunk_ahead(&scores(std::min(next0, m - 1), 0), scores.stride(0) * static_cast<std::ptrdiff_t>(sizeof(float)),
                                         static_cast<std::size_t>(n) * sizeof(float), chunk_stream ? next1 - next0 : 0, 0);
      std::size_t const row_lines = (static_cast<std::size_t>(n) * sizeof(float) + 63) / 64;
      for (index_t i = c * chunk; i < c1; ++i) {
        float const* s = &scores(i, 0);
        // Without the chunk stream, the next token's row into L2 while this one is ranked: a
        // server core's hardware prefetchers alone leave routing from DRAM far slower than from
        // cache. The AVX-512 selection spreads these prefetches over its work: three lines per
        // 64 scores in the candidate pass, one per ranked candidate, the rest once the token is
        // done, not all four lines per 64 scores in the pass (benchmarks/moe.md): a prefetch
        // issued faster than the core's memory stream drains them waits for a fill buffer, and
        // the instructions behind it cannot retire. The other paths issue the row here. After
        // a chunk's last token, the next row this thread routes is the first of the chunk it
        // has claimed.
        index_t const i_next = i + 1 < c1 ? i + 1 : c_next * chunk;
        float const* const next_row = i_next < m ? &scores(i_next, 0) : nullptr;
        if (next_row && !select512 && !chunk_stream) k3::detail::prefetch_span_l2(next_row, static_cast<std::size_t>(n) * sizeof(float));
        float const* rz = nullptr;  // the ISA selection's ranked k+1 best (else `best`)
        std::int32_t const* rj = nullptr;
        if (fast) {
          if (select512) {
            bool ranked;
            if (chunk_stream) {
              ranked = RK::select(s, bvec.data(), n, kk, *st512, {&chunk_ahead, 1, 0});
            } else {
              k3::detail::rows_ahead row_ahead(next_row, 0, next_row ? static_cast<std::size_t>(n) * sizeof(float) : 0, 1, 0);
              ranked = RK::select(s, bvec.data(), n, kk, *st512, {&row_ahead, 3, 1});
              row_ahead.step(std::size_t(-1));  // what the pass and the ranking left
            }
            if (!ranked) {
              if (!select_token_simd<Arch>(s, bvec.data(), n, kk, best.data(), st)) {
                bad_token[p] = i;
                failed.store(true, std::memory_order_relaxed);
                return;
              }
              for (index_t r = 0; r < kk; ++r) {
                st512->tz[r] = best[r].z;
                st512->tj[r] = best[r].j;
              }
            }
            RK::observe(*st512, st512->tz[kk - 1], st512->tz[0]);
            rz = st512->tz;
            rj = st512->tj;
          } else if (!select_token_simd<Arch>(s, bvec.data(), n, kk, best.data(), st)) {
            bad_token[p] = i;
            failed.store(true, std::memory_order_relaxed);
            return;
          }
        } else {
          for (index_t j = 0; j < n; ++j) {
            if (!std::isfinite(s[j])) {
              bad_token[p] = i;
              failed.store(true, std::memory_order_relaxed);
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
        float alpha;  // the cut-off, rank k
        if (rz) {
          RK::emit(i, s, rz, rj, opt, out, contiguous);
          if (ld)
            for (index_t r = 0; r < opt.k; ++r) ++ld[rj[r]];
          alpha = rz[opt.k];
        } else {
          if (!fast) rank_token(s, bias, opt, n, z, best);
          emit_token(i, s, best.data(), opt, out);
          if (ld)
            for (index_t r = 0; r < opt.k; ++r) ++ld[best[r].j];
          alpha = best[opt.k].z;
        }
        if (h) {
          if (blocked) {
            bin_token_simd<Arch>(s, alpha, n, hist->lo(), hist->inv_width(), B, bins.data() + in_block * bin_ld);
            ++in_block;
            if (select512) chunk_ahead.step((row_lines + 6) / 7);
          } else {
            scatter_token_simd<Arch>(s, alpha, n, hist->lo(), hist->inv_width(), B, h, carries[p]);
          }
        }
      }
      if (in_block > 0) {
        chunk_ahead.spread_over(n / 4);
        scatter_block(bins.data(), in_block, n, bin_ld, B, h, carries[p], chunk_ahead, paired_bins<Arch>);
        in_block = 0;
      }
    }
  });
  if (failed.load()) {
    index_t i = m;
    for (std::int64_t p = 0; p < parts; ++p)
      if (bad_token[p] >= 0) i = std::min(i, bad_token[p]);
    for (index_t j = 0; j < n; ++j)
      if (!std::isfinite(scores(i, j))) throw k3::error(error_kind::value, nonfinite_message(i, j, opt.input));
  }
  if (!out.load.empty())
    for (index_t j = 0; j < n; ++j) {
      std::int64_t c = 0;
      for (std::int64_t p = 0; p < parts; ++p) c += local_load[static_cast<std::size_t>(p) * load_ld + static_cast<std::size_t>(j)];
      out.load(j) = c;
    }
  if (hist) {
    // Just cleared (the usual first call of a step): merge_counts writes the sum without
    // reading the old counts.
    bool const fresh = hist->known_zero();
    std::int64_t* H = hist->data();
    std::int64_t const total = n * B;
    std::int64_t const chunks = std::min<std::int64_t>(total, 4 * backend.concurrency());
    std::vector<std::uint8_t const*> part_counts(static_cast<std::size_t>(parts));
    for (std::int64_t p = 0; p < parts; ++p) part_counts[static_cast<std::size_t>(p)] = local_h[p]->data();
    backend.for_each_task(chunks, [&](std::int64_t c) {
      merge_counts<Arch>(H, part_counts.data(), parts, total * c / chunks, total * (c + 1) / chunks, fresh);
    });
    for (auto const& c : carries)
      for (std::size_t x = 0; x < c.used; ++x) H[c.at[x]] += 256;
  }
}

}  // namespace k3::moe::detail
