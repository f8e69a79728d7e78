// Adversarial API checks (round 4): the mix's outputs (h, stats; dsources, dpartial, dw,
// dgain) overlapping an input or each other must be rejected with a k3::error naming both.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "k3/attnres.hpp"

namespace ar = k3::attnres;
using k3::index_t;

namespace {
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (k3::error const& e) {
    return e.what();
  }
  return "";
}
bool names(std::string const& e, char const* a, char const* b) {
  return e.find(std::string("'") + a + "'") != std::string::npos && e.find(std::string("'") + b + "'") != std::string::npos &&
         e.find("overlap") != std::string::npos;
}
}  // namespace

TEST_CASE("attnres mix: stats and gradients overlapping inputs or each other are rejected") {
  index_t const n = 2, T = 3, d = 4;
  // slots of 64 doubles in one buffer
  std::vector<double> mem(64 * 16, 0.25);
  for (std::size_t i = 0; i < mem.size(); ++i) mem[i] = 0.01 * double(i % 13) - 0.05;
  auto at = [&](int i) { return mem.data() + 64 * i; };
  auto bank = k3::host_view(static_cast<double const*>(at(0)), n, T, d);
  auto part = k3::host_view(static_cast<double const*>(at(1)), T, d);
  auto src = ar::make_sources(bank, part);
  auto w = k3::host_view(static_cast<double const*>(at(2)), d);
  auto g = k3::host_view(static_cast<double const*>(at(3)), d);
  k3::cpu::threads<> thr(2);
  auto fwd = [&](double* h, double* st) {
    return error_of([&] { ar::mix_forward(thr, src, w, g, k3::host_view(h, T, d), {}, k3::host_view(st, T, n + 1, index_t(3))); });
  };
  CHECK(fwd(at(4), at(5)) == "");
  CHECK(names(fwd(at(4), at(0)), "stats", "sources"));
  CHECK(names(fwd(at(4), at(1)), "stats", "partial"));
  CHECK(names(fwd(at(4), at(4) + 3), "stats", "h"));

  auto dh = k3::host_view(static_cast<double const*>(at(6)), T, d);
  auto bwd = [&](double* db, double* dp, double* dw, double* dg) {
    return error_of([&] {
      ar::mix_backward(thr, src, w, g, dh, ar::make_grads(k3::host_view(db, n, T, d), k3::host_view(dp, T, d)), k3::host_view(dw, d),
                       k3::host_view(dg, d));
    });
  };
  CHECK(bwd(at(7), at(8), at(9), at(10)) == "");
  CHECK(names(bwd(at(6), at(8), at(9), at(10)), "dsources", "dh"));
  CHECK(names(bwd(at(7), at(0) + 8, at(9), at(10)), "dpartial", "sources"));
  CHECK(names(bwd(at(7), at(8), at(2), at(10)), "dw", "w"));
  CHECK(names(bwd(at(7), at(8), at(9), at(9)), "dw", "dgain"));
  CHECK(names(bwd(at(7), at(8), at(7) + 2, at(10)), "dw", "dsources"));
  CHECK(names(bwd(at(7), at(8), at(9), at(6)), "dgain", "dh"));
  CHECK(names(bwd(at(7), at(7) + 8, at(9), at(10)), "dsources", "dpartial"));
}
