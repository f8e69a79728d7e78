// The kind and argument of the errors real calls throw, one call per kind: what a caller that
// branches on k3::error's fields sees.
#include <doctest/doctest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "k3/comm/communicator.hpp"
#include "k3/dplr.hpp"
#include "k3/io/npy.hpp"
#include "k3/kda.hpp"

using namespace k3;

namespace {

struct caught {
  bool thrown = false;
  error_kind kind = error_kind::value;
  std::string argument, subject, detail, related, message;
};

caught catch_error(std::function<void()> const& f) {
  caught c;
  try {
    f();
  } catch (error const& e) {
    c = {true, e.kind(), e.argument(), e.subject(), std::string(e.detail()), e.related(), std::string(e.message())};
  }
  return c;
}

// A small valid KDA forward: B = 1, T = 5, H = 1, K = V = 4.
struct kda_problem {
  std::vector<float> q = std::vector<float>(20, 0.1f), v = std::vector<float>(20, 1.f), g = std::vector<float>(20, -0.5f),
                     beta = std::vector<float>(5, 0.5f), o = std::vector<float>(20);
  kda::forward_args<float> args() const {
    kda::forward_args<float> a;
    a.q = host_view(q.data(), 1, 5, 1, 4);
    a.k = a.q;
    a.v = host_view(v.data(), 1, 5, 1, 4);
    a.g = host_view(g.data(), 1, 5, 1, 4);
    a.beta = host_view(beta.data(), 1, 5, 1);
    a.o = host_view(const_cast<float*>(o.data()), 1, 5, 1, 4);
    return a;
  }
};

}  // namespace

TEST_CASE("error kinds: a valid call throws nothing") {
  kda_problem p;
  CHECK_FALSE(catch_error([&] { kda::forward(cpu::serial{}, p.args()); }).thrown);
}

TEST_CASE("error kinds: shape, with the argument named") {
  kda_problem p;
  auto a = p.args();
  a.k = host_view(p.q.data(), 1, 4, 1, 5);
  caught const c = catch_error([&] { kda::forward(cpu::serial{}, a); });
  REQUIRE(c.thrown);
  CHECK(c.kind == error_kind::shape);
  CHECK(c.argument == "k");
  CHECK(c.subject == "argument");
  CHECK(c.detail.find("expected shape") != std::string::npos);
}

TEST_CASE("error kinds: aliasing names the output first") {
  kda_problem p;
  auto a = p.args();
  a.o = host_view(p.v.data(), 1, 5, 1, 4);  // o over v
  caught const c = catch_error([&] { kda::forward(cpu::serial{}, a); });
  REQUIRE(c.thrown);
  CHECK(c.kind == error_kind::aliasing);
  CHECK(c.argument == "o");
  CHECK(c.message.find("'v'") != std::string::npos);
}

TEST_CASE("error kinds: a bad option value, and an input breaking an option's promise") {
  kda_problem p;
  kda::options opt;
  opt.gate_lower_bound = 0.5;
  caught c = catch_error([&] { kda::forward(cpu::serial{}, p.args(), opt); });
  REQUIRE(c.thrown);
  CHECK(c.kind == error_kind::value);
  CHECK(c.argument == "gate_lower_bound");
  CHECK(c.subject == "option");
  CHECK(c.related.empty());

  opt.gate_lower_bound = -0.25;  // every g is -0.5
  c = catch_error([&] { kda::forward(cpu::serial{}, p.args(), opt); });
  REQUIRE(c.thrown);
  CHECK(c.kind == error_kind::value);
  CHECK(c.argument == "g");
  CHECK(c.related == "gate_lower_bound");
}

TEST_CASE("error kinds: io for a malformed file, dtype for the wrong element type") {
  std::vector<unsigned char> junk{'n', 'o', 't', ' ', 'n', 'p', 'y', 0, 0, 0, 0, 0};
  caught c = catch_error([&] { (void)io::parse_npy(junk); });
  REQUIRE(c.thrown);
  CHECK(c.kind == error_kind::io);
  CHECK(c.argument.empty());

  io::npy_array arr(io::dtype::int64, {3});
  c = catch_error([&] { (void)arr.view<float, 1>("scores"); });
  REQUIRE(c.thrown);
  CHECK(c.kind == error_kind::dtype);
  CHECK(c.argument == "scores");
}

TEST_CASE("error kinds: unsupported for a valid request the op does not serve") {
  std::vector<float> x(2 * 4 * 1 * 3, 0.1f), gk(x.size(), -0.1f), o(x.size());
  std::vector<std::int64_t> cu{0, 2};
  auto v4 = host_view(static_cast<float const*>(x.data()), 1, 2, 1, 3);
  single_process const one;
  dplr::cp_forward_args<float, single_process> in{&one, v4, v4, v4, v4, v4, host_view(static_cast<float const*>(gk.data()), 1, 2, 1, 3), {},
                                                  host_view(o.data(), 1, 2, 1, 3)};
  dplr::options opt;
  opt.cu_seqlens = host_view(static_cast<std::int64_t const*>(cu.data()), 2);
  caught const c = catch_error([&] { dplr::forward(cpu::serial{}, in, opt); });
  REQUIRE(c.thrown);
  CHECK(c.kind == error_kind::unsupported);
}
