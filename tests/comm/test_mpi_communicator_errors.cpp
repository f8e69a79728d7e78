// Under mpirun -np 2, 3, 4: a buffer that one rank's own checks reject (a wrong all_gather
// output size, a non-contiguous view) must make every rank throw k3::error, not leave the
// others waiting in a collective or pair their collective with the next call; after such an
// error the communicator keeps working. Point to point: a rejected send buffer makes the
// receiver throw, a rejected receive buffer still consumes the message.
// No doctest: every rank takes part in every check.
#include <cstdio>
#include <string>
#include <vector>

#include "k3/comm/mpi.hpp"
#include "support/error_of.hpp"
#include "support/mpi_check.hpp"

using k3::index_t;
using k3::test::error_of;

namespace {

// A good collective right after: every rank gets the right sum (a collective left pending by
// an earlier call would pair with this one and give wrong numbers, an error or a hang).
void still_works(k3::mpi_communicator const& c, int line) {
  int const r = c.rank(), n = c.size();
  std::vector<double> x = {double(r + 1)};
  c.all_reduce_sum(k3::host_view(x.data(), 1));
  EXPECT(x[0] == n * (n + 1) / 2.0, "after the check at line %d: sum %g", line, x[0]);
  std::vector<std::int64_t> mine = {r}, all(static_cast<std::size_t>(n));
  c.all_gather(k3::tensor_view<std::int64_t const, 1>(mine.data(), {1}), k3::host_view(all.data(), n));
  for (int q = 0; q < n; ++q) EXPECT(all[std::size_t(q)] == q, "after the check at line %d", line);
}

}  // namespace

int main(int argc, char** argv) {
  k3::mpi_session session(&argc, &argv);
  k3::mpi_communicator c;
  int const r = c.rank(), n = c.size();
  bool const odd_one = r == n - 1;

  // all_gather: the last rank's output is one element short
  {
    std::vector<float> mine = {float(r), 1.f}, all(std::size_t(2 * n - (odd_one ? 1 : 0)));
    auto msg = error_of([&] { c.all_gather(k3::tensor_view<float const, 1>(mine.data(), {2}), k3::host_view(all.data(), index_t(all.size()))); });
    EXPECT(msg.find(odd_one ? "output must hold" : "another rank") != std::string::npos, "rank %d: '%s'", r, msg.c_str());
    still_works(c, __LINE__);
  }
  // all_gather: a non-contiguous input on rank 0
  {
    std::vector<double> buf(4, 1.0), all(std::size_t(2 * n));
    auto in = r == 0 ? k3::tensor_view<double const, 1>(buf.data(), {2}, {2}) : k3::tensor_view<double const, 1>(buf.data(), {2});
    auto msg = error_of([&] { c.all_gather(in, k3::host_view(all.data(), 2 * n)); });
    EXPECT(msg.find(r == 0 ? "contiguous" : "another rank") != std::string::npos, "rank %d: '%s'", r, msg.c_str());
    still_works(c, __LINE__);
  }
  // all_reduce_sum: a non-contiguous buffer on the last rank
  {
    std::vector<double> buf(6, 1.0);
    auto v = odd_one ? k3::tensor_view<double, 1>(buf.data(), {3}, {2}) : k3::tensor_view<double, 1>(buf.data(), {3});
    auto msg = error_of([&] { c.all_reduce_sum(v); });
    EXPECT(msg.find(odd_one ? "contiguous" : "another rank") != std::string::npos, "rank %d: '%s'", r, msg.c_str());
    still_works(c, __LINE__);
  }
  // send with a rejected buffer: the receiver throws instead of waiting
  if (r < 2) {
    std::vector<float> buf(6, 2.f);
    if (r == 0) {
      auto msg = error_of([&] { c.send(k3::tensor_view<float const, 1>(buf.data(), {3}, {2}), 1, 5); });
      EXPECT(msg.find("contiguous") != std::string::npos, "rank 0: '%s'", msg.c_str());
    } else {
      std::vector<float> in(3);
      auto msg = error_of([&] { c.recv(k3::host_view(in.data(), 3), 0, 5); });
      EXPECT(msg.find("sender rejected") != std::string::npos, "rank 1: '%s'", msg.c_str());
    }
  }
  // recv into a rejected buffer: the message is consumed, the next one on the tag arrives intact
  if (r < 2) {
    if (r == 0) {
      std::vector<float> a = {1, 2, 3}, b = {4, 5, 6};
      c.send(k3::tensor_view<float const, 1>(a.data(), {3}), 1, 6);
      c.send(k3::tensor_view<float const, 1>(b.data(), {3}), 1, 6);
    } else {
      std::vector<float> buf(6, 0.f), in(3, 0.f);
      auto msg = error_of([&] { c.recv(k3::tensor_view<float, 1>(buf.data(), {3}, {2}), 0, 6); });
      EXPECT(msg.find("contiguous") != std::string::npos, "rank 1: '%s'", msg.c_str());
      c.recv(k3::host_view(in.data(), 3), 0, 6);
      EXPECT(in[0] == 4 && in[1] == 5 && in[2] == 6, "rank 1 got %g %g %g", double(in[0]), double(in[1]), double(in[2]));
    }
  }
  still_works(c, __LINE__);
  c.barrier();
  return k3::test::mpi_verdict(c);
}
