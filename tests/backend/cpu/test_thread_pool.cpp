#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <thread>
#include <stdexcept>
#include <vector>

#include "k3/backend/cpu/thread_pool.hpp"

TEST_CASE("each task runs exactly once, many times over") {
  k3::cpu::thread_pool pool(4);
  for (int round = 0; round < 200; ++round) {
    std::int64_t n = round % 17;
    std::vector<std::atomic<int>> hits(static_cast<std::size_t>(n));
    pool.run(n, [&](std::int64_t i) { hits[static_cast<std::size_t>(i)]++; });
    for (auto& h : hits) REQUIRE(h.load() == 1);
  }
}

TEST_CASE("nested runs execute inline instead of deadlocking") {
  k3::cpu::thread_pool pool(2);
  std::atomic<int> total{0};
  pool.run(4, [&](std::int64_t) { pool.run(3, [&](std::int64_t) { total++; }); });
  CHECK(total.load() == 12);
}

TEST_CASE("an exception in a task reaches the caller after all tasks finish") {
  k3::cpu::thread_pool pool(3);
  std::atomic<int> ran{0};
  CHECK_THROWS_AS(pool.run(10,
                           [&](std::int64_t i) {
                             ran++;
                             if (i == 4) throw std::runtime_error("boom");
                           }),
                  std::runtime_error);
  CHECK(ran.load() == 10);
  // the pool is still usable
  std::atomic<int> again{0};
  pool.run(5, [&](std::int64_t) { again++; });
  CHECK(again.load() == 5);
}

TEST_CASE("pool sizes, empty runs, and callers from several threads at once") {
  k3::cpu::thread_pool def;
  CHECK(def.size() == static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  k3::cpu::thread_pool one(1);
  CHECK(one.size() == 1);
  int calls = 0;
  one.run(0, [&](std::int64_t) { ++calls; });
  one.run(-3, [&](std::int64_t) { ++calls; });
  CHECK(calls == 0);

  k3::cpu::thread_pool pool(3);
  std::atomic<std::int64_t> total{0};
  std::vector<std::thread> callers;
  for (int t = 0; t < 4; ++t)
    callers.emplace_back([&] {
      for (int r = 0; r < 50; ++r) pool.run(7, [&](std::int64_t i) { total += i + 1; });
    });
  for (auto& c : callers) c.join();
  CHECK(total.load() == 4 * 50 * 28);
}

TEST_CASE("tasks run in the caller's floating-point control state, whichever thread takes them") {
  using k3::detail::float_env;
  k3::cpu::thread_pool pool(3);
  float_env const plain = float_env::current();
  auto envs_of_tasks = [&] {
    std::vector<float_env> seen(64);
    pool.run(64, [&](std::int64_t i) {
      seen[static_cast<std::size_t>(i)] = float_env::current();
      std::this_thread::yield();  // let every worker take some
    });
    return seen;
  };
  {
    k3::detail::subnormals_flushed const flush;
    float_env const caller = float_env::current();
    for (auto const& e : envs_of_tasks()) CHECK(e == caller);
  }
  // Back in the plain state: the workers do not keep the previous caller's.
  for (auto const& e : envs_of_tasks()) CHECK(e == plain);
}
