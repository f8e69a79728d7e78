// Random test data shared by the suites: reproducible Gaussian vectors.
#pragma once
#include <cstddef>
#include <random>
#include <vector>

namespace k3::test {

// n samples of N(0, scale^2) from a 64-bit Mersenne Twister seeded with `seed`.
inline std::vector<double> gaussian(std::size_t n, unsigned seed, double scale = 1.0) {
  std::mt19937_64 r(seed);
  std::normal_distribution<double> nd(0.0, scale);
  std::vector<double> v(n);
  for (auto& x : v) x = nd(r);
  return v;
}

}  // namespace k3::test
