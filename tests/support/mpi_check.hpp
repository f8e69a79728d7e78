// Checks for the MPI tests. They use a plain main, not doctest: every rank must take part in
// every collective, so a failed check is counted and the run goes on; at the end the counts
// are summed over the ranks and every rank exits with the same status.
#pragma once
#include <cstdint>
#include <cstdio>
#include <vector>

#include "k3/comm/communicator.hpp"
#include "k3/core/tensor_view.hpp"

namespace k3::test {

inline int& mpi_failures() {
  static int count = 0;
  return count;
}

// Sums the failed checks over the ranks; rank 0 prints the verdict. Returns the exit status.
template <class Comm>
int mpi_verdict(Comm& comm) {
  std::vector<std::int64_t> total = {mpi_failures()};
  comm.all_reduce_sum(k3::host_view(total.data(), 1));
  if (comm.rank() == 0)
    std::printf("%s: %d ranks, %lld failed checks\n", total[0] ? "FAILED" : "passed", comm.size(), (long long)total[0]);
  return total[0] ? 1 : 0;
}

}  // namespace k3::test

// EXPECT(cond) or EXPECT(cond, printf-format, args...): prints the line, the condition and the
// optional message on a failure, counts it, and carries on.
#define EXPECT(cond, ...)                                                      \
  do {                                                                         \
    if (!(cond)) {                                                             \
      std::printf("rank check failed at line %d: %s", __LINE__, #cond);       \
      __VA_OPT__(std::printf(": "); std::printf(__VA_ARGS__);)                 \
      std::printf("\n");                                                       \
      ++::k3::test::mpi_failures();                                            \
    }                                                                          \
  } while (0)
