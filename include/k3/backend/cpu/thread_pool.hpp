// k3/backend/cpu/thread_pool.hpp — a small persistent pool for independent work
// (batch x heads, blocks of tokens). The calling thread takes part, so a pool of n threads
// starts n-1 workers. A call made from inside a task runs inline: nested parallelism never
// deadlocks, it just does not fan out twice.
#pragma once
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "k3/core/error.hpp"
#include "k3/core/float_env.hpp"

namespace k3::cpu {

class thread_pool {
 public:
  // threads <= 0: one per hardware thread.
  explicit thread_pool(int threads = 0) {
    if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    size_ = threads;
    workers_.reserve(static_cast<std::size_t>(threads - 1));
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { worker_loop(); });
  }
  thread_pool(thread_pool const&) = delete;
  thread_pool& operator=(thread_pool const&) = delete;
  ~thread_pool() {
    {
      std::lock_guard lk(m_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
  }

  int size() const noexcept { return size_; }

  // Runs task(i) for i in [0, tasks), each exactly once, and returns when all are done.
  // The first exception thrown by a task is rethrown here after the others finish.
  template <class F>
  void run(std::int64_t tasks, F&& task) {
    if (tasks <= 0) return;
    if (tasks == 1 || size_ == 1 || inside_task()) {
      for (std::int64_t i = 0; i < tasks; ++i) task(i);
      return;
    }
    std::lock_guard run_lock(run_m_);  // one fan-out at a time from outside threads
    job j;
    j.fn = [&task](std::int64_t i) { task(i); };
    j.tasks = tasks;
    j.env = detail::float_env::current();
    {
      std::lock_guard lk(m_);
      job_ = &j;
      ++generation_;
    }
    cv_.notify_all();
    work_on(j);
    {
      std::unique_lock lk(m_);
      done_cv_.wait(lk, [&] { return j.finished == j.tasks && active_ == 0; });
      job_ = nullptr;
    }
    if (j.err) std::rethrow_exception(j.err);
  }

 private:
  struct job {
    std::function<void(std::int64_t)> fn;
    std::int64_t tasks = 0;
    detail::float_env env;  // the caller's, applied by the workers while they work on the job
    std::atomic<std::int64_t> next{0};
    std::int64_t finished = 0;  // guarded by the pool mutex
    std::exception_ptr err;     // guarded by the pool mutex
  };

  static bool& inside_task() noexcept {
    thread_local bool flag = false;
    return flag;
  }

  void work_on(job& j) {
    bool const was_inside = inside_task();
    inside_task() = true;
    std::int64_t done = 0;
    std::exception_ptr err;
    for (;;) {
      std::int64_t i = j.next.fetch_add(1, std::memory_order_relaxed);
      if (i >= j.tasks) break;
      try {
        j.fn(i);
      } catch (...) {
        if (!err) err = std::current_exception();
      }
      ++done;
    }
    inside_task() = was_inside;
    std::lock_guard lk(m_);
    j.finished += done;
    if (err && !j.err) j.err = err;
    if (j.finished == j.tasks) done_cv_.notify_all();
  }

  void worker_loop() {
    std::uint64_t seen = 0;
    for (;;) {
      job* j = nullptr;
      {
        std::unique_lock lk(m_);
        cv_.wait(lk, [&] { return stop_ || (job_ != nullptr && generation_ != seen); });
        if (stop_) return;
        seen = generation_;
        j = job_;
        ++active_;
      }
      detail::float_env const own = detail::float_env::current();
      j->env.apply();
      work_on(*j);
      own.apply();
      {
        std::lock_guard lk(m_);
        --active_;
      }
      done_cv_.notify_all();
    }
  }

  int size_ = 1;
  std::vector<std::thread> workers_;
  std::mutex m_, run_m_;
  std::condition_variable cv_, done_cv_;
  job* job_ = nullptr;
  std::uint64_t generation_ = 0;
  int active_ = 0;
  bool stop_ = false;
};

}  // namespace k3::cpu
