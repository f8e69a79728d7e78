// k3/dplr/pipeline.hpp — one (sequence, head) on every thread: the state-independent
// intra-chunk work ("build", one chunk at a time) and the state pass ("step", one block of
// state columns, a "part", one chunk at a time, in order) run as a single fan-out with atomic
// hand-offs instead of one pool fan-out per block of chunks.
//
// Chunks are visited in sequence order s = 0, 1, ... (the caller maps s to a chunk, so the
// backward runs them in reverse). A ring of `slots` built chunks sits between the two kinds of
// work: any thread builds the next unbuilt chunk when its ring slot is free; any thread steps
// any part whose next chunk is built (its own part first: parts are locked, not owned). After
// every part has stepped chunk s, the last one runs finish(s) (the backward's per-chunk
// parameter gradients) and frees the slot. Because no part is bound to a thread, the scheme
// cannot deadlock when the pool runs the participants one after another (a nested call runs
// inline), and a thread that the OS deschedules does not stall the others: they take over its
// part. Each part's columns are stepped in chunk order by whichever thread holds it, so the
// result does not depend on the schedule.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <vector>

#include "k3/core/arch/target.hpp"
#include "k3/core/tensor_view.hpp"

namespace k3::detail::dplr {

struct alignas(64) pipeline_part {
  std::atomic<index_t> next{0};  // next sequence position to step
  std::atomic<bool> busy{false};
};

struct alignas(64) pipeline_slot {
  std::atomic<index_t> built{-1};  // sequence position whose intra data the slot holds
  std::atomic<index_t> free_for{0};  // sequence position that may be built into it next
  std::atomic<index_t> pending{0};   // parts that have not yet stepped the built position
};

// build(s, slot, worker): intra-chunk work of position s into ring slot `slot`; worker in
// [0, par.size()) identifies the calling thread's scratch (hot in its cache).
// step(part, s, slot): advance part's state columns over position s (calls for one part are
// serialised and in order). finish(s, slot): after every part stepped s, before the slot is
// reused. par.run(n, f) runs f(0..n-1), possibly concurrently.
template <class Par, class Build, class Step, class Finish>
void run_pipeline(Par const& par, index_t n, index_t parts, index_t slots, Build&& build, Step&& step, Finish&& finish) {
  if (n <= 0) return;
  int const P = par.size();
  if (P <= 1) {
    for (index_t s = 0; s < n; ++s) {
      build(s, index_t(0), index_t(0));
      for (index_t q = 0; q < parts; ++q) step(q, s, index_t(0));
      finish(s, index_t(0));
    }
    return;
  }
  std::unique_ptr<pipeline_part[]> pt(new pipeline_part[static_cast<std::size_t>(parts)]);
  std::unique_ptr<pipeline_slot[]> sl(new pipeline_slot[static_cast<std::size_t>(slots)]);
  for (index_t i = 0; i < slots; ++i) {
    sl[i].free_for.store(i, std::memory_order_relaxed);
    sl[i].pending.store(parts, std::memory_order_relaxed);
  }
  alignas(64) std::atomic<index_t> next_build{0};
  alignas(64) std::atomic<index_t> parts_done{0};
  alignas(64) std::atomic<int> epoch{0};  // bumped on every hand-off; idle threads wait on it
  alignas(64) std::atomic<int> ids{0};
  std::atomic<bool> failed{false};

  auto bump = [&] {
    epoch.fetch_add(1, std::memory_order_release);
    epoch.notify_all();
  };
  // After part q stepped position s: the last part to do so finishes s and frees its slot.
  auto release = [&](index_t s) {
    index_t const k = s % slots;
    if (sl[k].pending.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    finish(s, k);
    sl[k].pending.store(parts, std::memory_order_relaxed);
    sl[k].free_for.store(s + slots, std::memory_order_release);
  };
  auto try_step = [&](index_t q) {
    index_t s = pt[q].next.load(std::memory_order_acquire);
    if (s >= n || sl[s % slots].built.load(std::memory_order_acquire) != s) return false;
    if (pt[q].busy.exchange(true, std::memory_order_acquire)) return false;
    s = pt[q].next.load(std::memory_order_relaxed);  // may have moved before we locked
    bool ok = s < n && sl[s % slots].built.load(std::memory_order_acquire) == s;
    if (ok) {
      step(q, s, s % slots);
      pt[q].next.store(s + 1, std::memory_order_release);
      if (s + 1 == n) parts_done.fetch_add(1, std::memory_order_acq_rel);
    }
    pt[q].busy.store(false, std::memory_order_release);
    if (ok) {
      release(s);
      bump();
    }
    return ok;
  };
  auto try_build = [&](index_t worker) {
    index_t j = next_build.load(std::memory_order_relaxed);
    if (j >= n || sl[j % slots].free_for.load(std::memory_order_acquire) != j) return false;
    if (!next_build.compare_exchange_strong(j, j + 1, std::memory_order_acq_rel)) return false;
    build(j, j % slots, worker);
    sl[j % slots].built.store(j, std::memory_order_release);
    bump();
    return true;
  };

  par.run(P, [&](index_t) {
    index_t const me = ids.fetch_add(1, std::memory_order_relaxed), home = me % parts;
    try {
      while (!failed.load(std::memory_order_relaxed) && parts_done.load(std::memory_order_acquire) < parts) {
        int const seen = epoch.load(std::memory_order_acquire);
        bool progress = false;
        for (index_t i = 0; i < parts && !progress; ++i) progress = try_step((home + i) % parts);
        if (!progress) progress = try_build(me);
        if (progress) continue;
        // Nothing to do until another thread hands something off: spin briefly (~10 us; on
        // idle cores a wait ends when a build or step of the other thread does, and a
        // futex wake-up costs about as much), then sleep on the epoch.
        int spins = 0;
        while (epoch.load(std::memory_order_acquire) == seen && ++spins < 512) ::k3::detail::target::cpu_relax();
        if (epoch.load(std::memory_order_acquire) == seen && parts_done.load(std::memory_order_acquire) < parts)
          epoch.wait(seen, std::memory_order_acquire);
      }
    } catch (...) {
      failed.store(true, std::memory_order_release);
      bump();
      throw;
    }
  });
}

}  // namespace k3::detail::dplr
