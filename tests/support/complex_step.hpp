// Complex-step derivatives for the tests' float64 references: a reference templated on its
// scalar, run in std::complex<double> at x + i h, gives df/dx = Im f(x + i h) / h with no
// subtractive cancellation, so the derivative is exact to double rounding (the truncation error,
// h^2 f''' / 6, is far below it). Only the functions the reference uses must be holomorphic.
#pragma once
#include <algorithm>
#include <cmath>
#include <complex>
#include <cstddef>
#include <vector>

namespace k3::test {

// The step at x: 1e-20 relative to max(1, |x|), large enough that h f'(x) stays a normal double
// for small derivatives, small enough that h^2 terms vanish.
inline double complex_step_size(double x) { return 1e-20 * std::max(1.0, std::fabs(x)); }

// df/dx at x of a scalar function f(std::complex<double>).
template <class F>
double complex_step_derivative(double x, F&& f) {
  double const h = complex_step_size(x);
  return std::imag(f(std::complex<double>(x, h))) / h;
}

// The gradient of a real scalar loss with respect to every element of z (a real point stored as
// complex, imaginary parts 0): element i is moved to z_i + i h, loss() (which reads z and returns
// the complex loss) gives d loss / d z_i = Im loss() / h, and z_i is restored.
template <class F>
std::vector<double> complex_step_gradient(std::vector<std::complex<double>>& z, F&& loss) {
  std::vector<double> grad(z.size());
  for (std::size_t i = 0; i < z.size(); ++i) {
    std::complex<double> const keep = z[i];
    double const h = complex_step_size(keep.real());
    z[i] = std::complex<double>(keep.real(), h);
    grad[i] = std::imag(loss()) / h;
    z[i] = keep;
  }
  return grad;
}

}  // namespace k3::test
