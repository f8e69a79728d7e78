// Uses the installed k3: a tensor_view over user memory, the thread-pool backend, .npy I/O.
#include <k3/k3.hpp>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

int main(int argc, char** argv) {
  std::string const dir = argc > 1 ? argv[1] : ".";
  int const rows = 37, cols = 53;
  std::vector<float> x(rows * cols);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = std::sin(0.01f * static_cast<float>(i));
  auto xv = k3::host_view(x.data(), rows, cols);

  // Row sums on the thread pool (one independent task per row), then a serial check.
  k3::cpu::threads<> pool(2);
  std::vector<double> sums(rows);
  pool.for_each(0, rows, [&](std::int64_t r) {
    double s = 0;
    for (k3::index_t c = 0; c < cols; ++c) s += xv(r, c);
    sums[static_cast<std::size_t>(r)] = s;
  });

  std::string const path = dir + "/consumer_row_sums.npy";
  k3::io::write_npy(path, k3::host_view(sums.data(), rows));
  k3::io::npy_array const file = k3::io::read_npy(path);  // owns the data the view points to
  auto back = file.view<double, 1>("row_sums");
  double err = 0;
  for (k3::index_t r = 0; r < rows; ++r) {
    double s = 0;
    for (k3::index_t c = 0; c < cols; ++c) s += x[static_cast<std::size_t>(r * cols + c)];
    err = std::fmax(err, std::fabs(back(r) - s));
  }
  std::printf("k3 %s consumer: %d row sums on %d threads, written and read back as .npy, max error %g\n",
              k3::version_string, rows, pool.concurrency(), err);
  return err == 0 ? 0 : 1;
}
