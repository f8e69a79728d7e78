// Runs under mpirun -np 2 and -np 4. No doctest: every rank must take part in every check.
#include <cstdio>
#include <vector>

#include "k3/comm/mpi.hpp"
#include "support/mpi_check.hpp"


int main(int argc, char** argv) {
  k3::mpi_session session(&argc, &argv);
  k3::mpi_communicator c;
  int const r = c.rank(), n = c.size();

  // all-reduce of doubles and int64 counts
  std::vector<double> x = {double(r), 1.0};
  c.all_reduce_sum(k3::host_view(x.data(), 2));
  EXPECT(x[0] == n * (n - 1) / 2.0 && x[1] == n);
  std::vector<std::int64_t> h = {r + 1};
  c.all_reduce_sum(k3::host_view(h.data(), 1));
  EXPECT(h[0] == n * (n + 1) / 2);

  // all-gather
  std::vector<float> mine = {float(r), float(10 * r)}, all(2 * n);
  c.all_gather(k3::tensor_view<float const, 1>(mine.data(), {2}), k3::host_view(all.data(), 2 * n));
  for (int q = 0; q < n; ++q) EXPECT(all[2 * q] == q && all[2 * q + 1] == 10 * q);

  // ring send/recv
  std::vector<float> out = {float(r)}, in(1);
  int next = (r + 1) % n, prev = (r + n - 1) % n;
  if (r % 2 == 0) {
    c.send(k3::tensor_view<float const, 1>(out.data(), {1}), next, 7);
    c.recv(k3::host_view(in.data(), 1), prev, 7);
  } else {
    c.recv(k3::host_view(in.data(), 1), prev, 7);
    c.send(k3::tensor_view<float const, 1>(out.data(), {1}), next, 7);
  }
  EXPECT(in[0] == prev);

  // a peer that sends the wrong count gets a clear error on the receiver, no hang
  if (r == 0) {
    std::vector<float> three = {1, 2, 3};
    c.send(k3::tensor_view<float const, 1>(three.data(), {3}), 1, 9);
  } else if (r == 1) {
    std::vector<float> two(2);
    bool threw = false;
    try {
      c.recv(k3::host_view(two.data(), 2), 0, 9);
    } catch (k3::error const& e) {
      threw = std::string(e.what()).find("peer sent 3") != std::string::npos;
    }
    EXPECT(threw);
  }

  // mismatched all-reduce sizes throw on every rank
  std::vector<double> y(static_cast<std::size_t>(r == 0 ? 3 : 2), 1.0);
  bool threw = false;
  try {
    c.all_reduce_sum(k3::host_view(y.data(), y.size()));
  } catch (k3::error const&) {
    threw = true;
  }
  EXPECT(threw);

  c.barrier();
  return k3::test::mpi_verdict(c);
}
