// k3/backend/simt/runtime.hpp — k3's SIMT runtime for the host: executes CUDA kernels compiled
// by a host compiler (see k3/backend/simt/cuda_api.hpp for the CUDA face of it).
//
// Design. A block's threads are fibers on the launching OS thread, one fiber per CUDA thread,
// each with its own stack; blocks run one after another. A fiber runs until it waits at a
// barrier (__syncthreads, or a warp barrier: __syncwarp, every shuffle and vote), then
// switches directly to the next runnable thread of its block. A barrier completes when every
// thread of its scope that has not exited has arrived (exited threads count as arrived, as
// on sm_70 and later). A warp is 32 consecutive linear thread indices. Shuffles exchange
// values through two per-warp buffers used alternately, one barrier per shuffle.
//
// What it checks: launch configurations and shared-memory limits of sm_90; barriers that can
// never complete (a deadlock is a launch failure that names where each thread waits); reads
// of dynamic shared memory before any write see NaN bytes (0xFF), as do fresh device
// allocations. Under ThreadSanitizer every fiber is a TSan thread and the only happens-before
// edges between threads of a block are the barriers (and atomics), so a missing
// __syncthreads or __syncwarp between a write and another thread's read or write of the same
// shared or global memory is reported as a data race. Not seen: races between different
// blocks (blocks run in order, and one block's static shared memory and stacks are reused by
// the next, so the runtime orders block after block), and hazards that depend on timing
// rather than ordering (the fiber schedule is deterministic).
#pragma once
#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define K3_SIMT_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__)
#define K3_SIMT_TSAN 1
#endif
#if defined(__has_feature)
#if __has_feature(address_sanitizer) && !defined(K3_SIMT_ASAN)
#define K3_SIMT_ASAN 1
#endif
#if __has_feature(thread_sanitizer) && !defined(K3_SIMT_TSAN)
#define K3_SIMT_TSAN 1
#endif
#endif
#if defined(K3_SIMT_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

// The runtime's own bookkeeping (barrier counts, thread states, the exchange buffers) is
// invisible to ThreadSanitizer: it is ordered by the single-threaded schedule, and only the
// kernel's memory accesses, ordered by nothing but barriers and atomics, are to be checked.
// Functions that touch it are not instrumented (and so never inlined into kernel code).
#if defined(K3_SIMT_TSAN)
#define K3_SIMT_BOOKKEEPING __attribute__((no_sanitize("thread")))
#else
#define K3_SIMT_BOOKKEEPING
#endif

#if defined(__x86_64__)
#include "k3/backend/simt/arch/x86_64.hpp"
#else
#include "k3/backend/simt/arch/ucontext.hpp"
#endif
#if defined(K3_SIMT_TSAN)
#include <sanitizer/tsan_interface.h>
#endif

namespace k3::simt {

#if defined(__x86_64__)
using context_switch = arch::x86_64;
#else
using context_switch = arch::ucontext;
#endif

struct index3 {
  unsigned x = 0, y = 0, z = 0;
};
struct extent3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr unsigned long long volume() const noexcept { return 1ull * x * y * z; }
};

inline constexpr unsigned warp_size = 32;
inline constexpr unsigned max_threads_per_block = 1024;
inline constexpr extent3 max_block_extent{1024, 1024, 64};
inline constexpr extent3 max_grid_extent{2147483647u, 65535u, 65535u};
inline constexpr std::size_t default_dynamic_shared_bytes = 48 * 1024;  // without an opt-in
inline constexpr std::size_t max_dynamic_shared_bytes = 227 * 1024;     // sm_90's opt-in limit

enum class launch_status { ok, bad_configuration, too_much_shared_memory, deadlock, kernel_threw };

// What one launch site ran: a count per kernel for reports.
struct launch_record {
  std::string kernel;
  std::uint64_t launches = 0, blocks = 0, threads = 0;
};

struct launch_request {
  void const* kernel = nullptr;  // identifies the kernel's shared-memory attribute
  std::string site;              // names the kernel in reports
  extent3 grid, block;
  std::size_t shared_bytes = 0;
  void (*body)(void*) = nullptr;  // runs one thread's kernel body
  void* arg = nullptr;
};

namespace detail {

#if defined(K3_SIMT_ASAN) || defined(K3_SIMT_TSAN)
inline constexpr std::size_t stack_bytes = std::size_t(1) << 20;  // sanitizers' frames are larger
#else
inline constexpr std::size_t stack_bytes = std::size_t(256) << 10;
#endif

enum class fiber_state : unsigned char { ready, block_barrier, warp_barrier, done };

struct fiber {
  context_switch::context ctx;
  void* mapping = nullptr;  // the stack with a guard page below it
  void* stack_base = nullptr;
  std::size_t stack_size = 0;
  fiber_state state = fiber_state::done;
  unsigned linear = 0;
  index3 tid;
  void* asan_fake_stack = nullptr;
  void* tsan_fiber = nullptr;
};

struct warp {
  unsigned first = 0, lanes = 0, alive = 0, arrived = 0;
  std::uint32_t arrived_mask = 0, present[2] = {0, 0};
  std::uint64_t generation = 0;
  std::uint64_t exchange[2][warp_size] = {};
  char sync[2] = {};  // TSan synchronisation addresses, one per generation parity
};

inline void tsan_release([[maybe_unused]] void* p) {
#if defined(K3_SIMT_TSAN)
  __tsan_release(p);
#endif
}
inline void tsan_acquire([[maybe_unused]] void* p) {
#if defined(K3_SIMT_TSAN)
  __tsan_acquire(p);
#endif
}

[[noreturn]] inline void misuse(char const* what) {
  std::fprintf(stderr, "k3 SIMT runtime: %s\n", what);
  std::abort();
}

class scheduler {
 public:
  scheduler() = default;
  scheduler(scheduler const&) = delete;
  scheduler& operator=(scheduler const&) = delete;
  ~scheduler() {
    for (fiber& f : fibers_)
      if (f.mapping) munmap(f.mapping, f.stack_size + page());
  }

  // Runs every block of the grid; returns ok or why not (with a description in *why).
  launch_status run(launch_request const& r, std::string* why) {
    nthreads_ = static_cast<unsigned>(r.block.volume());
    grid_ = r.grid;
    block_ = r.block;
    body_ = r.body;
    body_arg_ = r.arg;
    if (!reserve(nthreads_)) {
      if (why) *why = "cannot map fiber stacks";
      return launch_status::bad_configuration;
    }
    shared_.assign(r.shared_bytes + 16, std::byte{0});
    shared_bytes_ = r.shared_bytes;
    failure_ = nullptr;
    failed_ = false;
#if defined(K3_SIMT_TSAN)
    main_.tsan_fiber = __tsan_get_current_fiber();
#endif
    for (unsigned bz = 0; bz < grid_.z; ++bz)
      for (unsigned by = 0; by < grid_.y; ++by)
        for (unsigned bx = 0; bx < grid_.x; ++bx) {
          block_idx_ = {bx, by, bz};
          if (!run_block(why)) return failure_ ? launch_status::kernel_threw : launch_status::deadlock;
        }
    return launch_status::ok;
  }

  // ---- what the kernel sees ----------------------------------------------------------------
  K3_SIMT_BOOKKEEPING index3 thread_index() { return self().tid; }
  index3 block_index() const noexcept { return block_idx_; }
  extent3 block_extent() const noexcept { return block_; }
  extent3 grid_extent() const noexcept { return grid_; }
  std::byte* dynamic_shared() noexcept { return shared_.data(); }
  std::size_t dynamic_shared_bytes() const noexcept { return shared_bytes_; }

  K3_SIMT_BOOKKEEPING void sync_block() {
    fiber& f = self();
    auto const parity = generation_ & 1;
    tsan_release(&block_sync_[parity]);
    if (++arrived_ == alive_) {
      release_block();
    } else {
      f.state = fiber_state::block_barrier;
      suspend(f);
    }
    tsan_acquire(&block_sync_[parity]);
  }

  // A warp barrier; returns the parity of the round (which exchange buffer it used). Only
  // __syncwarp orders memory between the lanes (CUDA's memory model); shuffles and votes
  // exchange values and wait, but give a race detector no happens-before edge.
  K3_SIMT_BOOKKEEPING unsigned sync_warp(bool orders_memory = true) {
    fiber& f = self();
    warp& w = wrp_[f.linear / warp_size];
    unsigned const parity = static_cast<unsigned>(w.generation & 1);
    if (orders_memory) tsan_release(&w.sync[parity]);
    w.arrived_mask |= 1u << (f.linear % warp_size);
    if (++w.arrived == w.alive) {
      release_warp(w);
    } else {
      f.state = fiber_state::warp_barrier;
      suspend(f);
    }
    if (orders_memory) tsan_acquire(&w.sync[parity]);
    return parity;
  }

  // Every lane publishes `bits`; returns lane src's (or `bits` when src < 0, lies outside
  // the warp, or did not take part).
  template <class SourceLane>
  K3_SIMT_BOOKKEEPING std::uint64_t exchange(std::uint64_t bits, SourceLane source_of) {
    unsigned const parity = publish(bits);
    warp& w = wrp_[self().linear / warp_size];
    int const src = source_of(static_cast<int>(self().linear % warp_size));
    if (src < 0 || src >= static_cast<int>(warp_size) || !((w.present[parity] >> src) & 1u)) return bits;
    return w.exchange[parity][src];
  }

  // Every lane of the warp publishes `bits` and waits for the others; returns the parity of
  // the round, for present_lanes and exchanged.
  K3_SIMT_BOOKKEEPING unsigned publish(std::uint64_t bits) {
    {
      fiber& f = self();
      warp& w = wrp_[f.linear / warp_size];
      w.exchange[w.generation & 1][f.linear % warp_size] = bits;
    }
    return sync_warp(false);
  }
  // The lanes that took part in this lane's last publish, and what each published.
  K3_SIMT_BOOKKEEPING std::uint32_t present_lanes(unsigned parity) {
    return wrp_[self().linear / warp_size].present[parity];
  }
  K3_SIMT_BOOKKEEPING std::uint64_t exchanged(unsigned parity, unsigned lane) {
    return wrp_[self().linear / warp_size].exchange[parity][lane];
  }

 private:
  static std::size_t page() noexcept { return 4096; }

  K3_SIMT_BOOKKEEPING fiber& self() {
    if (current_ == nullptr || current_ == &main_) misuse("a device function was called outside a kernel");
    return *current_;
  }

  bool reserve(unsigned n) {
    if (fibers_.size() < n) fibers_.resize(n);  // fibers are plain data: their stacks move with them
    warps_.resize((n + warp_size - 1) / warp_size);
    fib_ = fibers_.data();
    wrp_ = warps_.data();
    for (unsigned i = 0; i < n; ++i) {
      fiber& f = fib_[i];
      if (f.mapping) continue;
      void* m = mmap(nullptr, stack_bytes + page(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (m == MAP_FAILED) return false;
      mprotect(m, page(), PROT_NONE);  // an overflowing kernel stack faults instead of corrupting
      f.mapping = m;
      f.stack_base = static_cast<char*>(m) + page();
      f.stack_size = stack_bytes;
#if defined(K3_SIMT_TSAN)
      f.tsan_fiber = __tsan_create_fiber(0);
#endif
    }
    return true;
  }

  bool run_block(std::string* why) {
    std::memset(shared_.data(), 0xFF, shared_.size());  // uninitialised shared memory reads as NaN
    alive_ = nthreads_;
    arrived_ = 0;
    generation_ = 0;
    for (unsigned w = 0; w < warps_.size(); ++w) {
      warp& wp = wrp_[w];
      wp.first = w * warp_size;
      wp.lanes = nthreads_ - wp.first < warp_size ? nthreads_ - wp.first : warp_size;
      wp.alive = wp.lanes;
      wp.arrived = 0;
      wp.arrived_mask = 0;
      wp.present[0] = wp.present[1] = 0;
      wp.generation = 0;
    }
    for (unsigned i = 0; i < nthreads_; ++i) {
      fiber& f = fib_[i];
      f.state = fiber_state::ready;
      f.linear = i;
      f.tid = {i % block_.x, (i / block_.x) % block_.y, i / (block_.x * block_.y)};
      f.asan_fake_stack = nullptr;
      context_switch::prepare(f.ctx, f.stack_base, f.stack_size, &entry, this);
    }
    tsan_release(&start_sync_);
    current_ = &main_;
    switch_to(main_, fib_[0]);
    current_ = nullptr;
    tsan_acquire(&end_sync_);
    if (failure_ || alive_ != 0) release_abandoned_stacks();
    if (failure_) {
      if (why) {
        try {
          std::rethrow_exception(failure_);
        } catch (std::exception const& e) {
          *why = std::string("a kernel thread threw: ") + e.what();
        } catch (...) {
          *why = "a kernel thread threw a non-standard exception";
        }
      }
      return false;
    }
    if (alive_ == 0) return true;
    if (why) *why = describe_deadlock();
    return false;
  }

  std::string describe_deadlock() const {
    unsigned at_block = 0, at_warp = 0, exited = 0;
    for (unsigned i = 0; i < nthreads_; ++i) {
      fiber_state const s = fib_[i].state;
      at_block += s == fiber_state::block_barrier;
      at_warp += s == fiber_state::warp_barrier;
      exited += s == fiber_state::done;
    }
    return "deadlock in block (" + std::to_string(block_idx_.x) + ", " + std::to_string(block_idx_.y) + ", " +
           std::to_string(block_idx_.z) + "): " + std::to_string(at_block) + " threads wait at __syncthreads, " +
           std::to_string(at_warp) + " at a warp barrier (__syncwarp, shuffle or vote), " + std::to_string(exited) +
           " exited; a barrier was reached by only some threads of its block or warp";
  }

  K3_SIMT_BOOKKEEPING static void entry(void* arg) {
    auto& s = *static_cast<scheduler*>(arg);
    tsan_acquire(&s.start_sync_);
#if defined(K3_SIMT_ASAN)
    void const* bottom = nullptr;
    std::size_t size = 0;
    __sanitizer_finish_switch_fiber(nullptr, &bottom, &size);
    if (s.current_ == &s.fib_[0]) {  // thread 0 starts first, from the launching context
      s.main_stack_bottom_ = bottom;
      s.main_stack_size_ = size;
    }
#endif
    try {
      s.body_(s.body_arg_);
    } catch (...) {
      if (!s.failed_) s.failure_ = std::current_exception();
      s.failed_ = true;
    }
    s.exit_current();
  }

  [[noreturn]] K3_SIMT_BOOKKEEPING void exit_current() {
    tsan_release(&end_sync_);
    fiber* f;
    fiber* next;
    {
      f = current_;
      f->state = fiber_state::done;
      --alive_;
      warp& w = wrp_[f->linear / warp_size];
      --w.alive;
      // A barrier that waited only for this thread completes now.
      if (w.arrived != 0 && w.arrived == w.alive) release_warp(w);
      if (arrived_ != 0 && arrived_ == alive_) release_block();
      next = failed_ ? nullptr : find_ready(f->linear + 1);
      if (next == nullptr) next = &main_;
    }
    switch_to(*f, *next);
    misuse("an exited kernel thread was resumed");
  }

  K3_SIMT_BOOKKEEPING void release_block() {
    arrived_ = 0;
    ++generation_;
    for (unsigned i = 0; i < nthreads_; ++i)
      if (fib_[i].state == fiber_state::block_barrier) fib_[i].state = fiber_state::ready;
  }

  K3_SIMT_BOOKKEEPING void release_warp(warp& w) {
    w.present[w.generation & 1] = w.arrived_mask;
    w.arrived = 0;
    w.arrived_mask = 0;
    ++w.generation;
    for (unsigned i = w.first; i < w.first + w.lanes; ++i)
      if (fib_[i].state == fiber_state::warp_barrier) fib_[i].state = fiber_state::ready;
  }

  // Threads of a failed block never return: their frames' ASan redzones stay poisoned in
  // shadow memory and would be reported when the next block reuses the stacks.
  void release_abandoned_stacks() noexcept {
#if defined(K3_SIMT_ASAN)
    for (unsigned i = 0; i < nthreads_; ++i) __asan_unpoison_memory_region(fib_[i].stack_base, fib_[i].stack_size);
#endif
  }

  K3_SIMT_BOOKKEEPING fiber* find_ready(unsigned from) {
    for (unsigned k = 0; k < nthreads_; ++k) {
      unsigned const i = (from + k) % nthreads_;
      if (fib_[i].state == fiber_state::ready) return &fib_[i];
    }
    return nullptr;
  }

  K3_SIMT_BOOKKEEPING void suspend(fiber& f) {
    fiber* next = failed_ ? nullptr : find_ready(f.linear + 1);
    switch_to(f, next ? *next : main_);
  }

  K3_SIMT_BOOKKEEPING void switch_to(fiber& from, fiber& to) {
    context_switch::handle target;
    [[maybe_unused]] void* tsan_target = nullptr;
    {
      current_ = &to;
      target = context_switch::resume_handle(to.ctx);
      tsan_target = to.tsan_fiber;
#if defined(K3_SIMT_ASAN)
      bool const to_main = &to == &main_;
      __sanitizer_start_switch_fiber(from.state == fiber_state::done ? nullptr : &from.asan_fake_stack,
                                     to_main ? main_stack_bottom_ : to.stack_base, to_main ? main_stack_size_ : to.stack_size);
#endif
    }
#if defined(K3_SIMT_TSAN)
    __tsan_switch_to_fiber(tsan_target, __tsan_switch_to_fiber_no_sync);
#endif
    context_switch::jump(from.ctx, target);
#if defined(K3_SIMT_ASAN)
    __sanitizer_finish_switch_fiber(from.asan_fake_stack, nullptr, nullptr);
#endif
  }

  std::vector<fiber> fibers_;
  std::vector<warp> warps_;
  fiber* fib_ = nullptr;  // their elements, for the schedule's uninstrumented code (no
  warp* wrp_ = nullptr;   // std::vector calls there)
  fiber main_;
  fiber* current_ = nullptr;
  unsigned nthreads_ = 0, alive_ = 0, arrived_ = 0;
  std::uint64_t generation_ = 0;
  extent3 grid_, block_;
  index3 block_idx_;
  void (*body_)(void*) = nullptr;
  void* body_arg_ = nullptr;
  std::vector<std::byte> shared_;
  std::size_t shared_bytes_ = 0;
  std::exception_ptr failure_;  // the first exception a kernel thread threw
  bool failed_ = false;          // (what the schedule reads: a plain flag)
#if defined(K3_SIMT_ASAN)
  void const* main_stack_bottom_ = nullptr;  // the launching thread's stack, for ASan's switches
  std::size_t main_stack_size_ = 0;
#endif
  char block_sync_[2] = {}, start_sync_ = 0, end_sync_ = 0;
};

struct runtime_state {
  std::recursive_mutex launch_mutex;  // kernels run one at a time (static shared memory is per kernel, not per block)
  scheduler sched;
  scheduler* running = nullptr;
  std::map<void const*, std::size_t> shared_limit;  // per kernel, set by cudaFuncSetAttribute
  std::map<std::string, launch_record> records;
};

inline runtime_state& state() {
  static runtime_state s;
  return s;
}

K3_SIMT_BOOKKEEPING inline scheduler& running() {
  scheduler* s = state().running;
  if (s == nullptr) misuse("a device function was called outside a kernel");
  return *s;
}

}  // namespace detail

// The largest dynamic shared memory a kernel may be launched with (cudaFuncSetAttribute).
inline bool set_dynamic_shared_limit(void const* kernel, std::size_t bytes) {
  if (bytes > max_dynamic_shared_bytes) return false;
  auto& st = detail::state();
  std::lock_guard lock(st.launch_mutex);
  st.shared_limit[kernel] = bytes;
  return true;
}

// Runs a kernel to completion on the calling thread.
inline launch_status launch(launch_request const& r, std::string* why) {
  auto& st = detail::state();
  std::lock_guard lock(st.launch_mutex);
  auto fits = [](extent3 e, extent3 lim) { return e.x >= 1 && e.y >= 1 && e.z >= 1 && e.x <= lim.x && e.y <= lim.y && e.z <= lim.z; };
  if (!fits(r.grid, max_grid_extent) || !fits(r.block, max_block_extent) || r.block.volume() > max_threads_per_block) {
    if (why)
      *why = "launch configuration grid (" + std::to_string(r.grid.x) + ", " + std::to_string(r.grid.y) + ", " + std::to_string(r.grid.z) +
             "), block (" + std::to_string(r.block.x) + ", " + std::to_string(r.block.y) + ", " + std::to_string(r.block.z) +
             ") is outside sm_90's limits (block <= 1024 threads, (1024, 1024, 64); grid (2^31 - 1, 65535, 65535))";
    return launch_status::bad_configuration;
  }
  auto const lim = st.shared_limit.find(r.kernel);
  std::size_t const limit = lim == st.shared_limit.end() ? default_dynamic_shared_bytes : lim->second;
  if (r.shared_bytes > limit) {
    if (why)
      *why = std::to_string(r.shared_bytes) + " bytes of dynamic shared memory requested, the kernel's limit is " + std::to_string(limit) +
             (lim == st.shared_limit.end() ? " (raise it with cudaFuncSetAttribute)" : "");
    return launch_status::too_much_shared_memory;
  }
  launch_record& rec = st.records[r.site];
  if (rec.kernel.empty()) rec.kernel = r.site;
  ++rec.launches;
  rec.blocks += r.grid.volume();
  rec.threads += r.grid.volume() * r.block.volume();
  detail::scheduler* outer = st.running;
  if (outer != nullptr) detail::misuse("a kernel launched another kernel (dynamic parallelism is not emulated)");
  st.running = &st.sched;
  launch_status const s = st.sched.run(r, why);
  st.running = nullptr;
  return s;
}

// Every launch site run so far in this process, in name order.
inline std::vector<launch_record> launch_records() {
  auto& st = detail::state();
  std::lock_guard lock(st.launch_mutex);
  std::vector<launch_record> out;
  for (auto const& [site, rec] : st.records) out.push_back(rec);
  return out;
}

}  // namespace k3::simt
