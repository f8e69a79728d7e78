// `k3 route` end to end: writes .npy inputs, runs the tool, compares with the library.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <unistd.h>
#include <utility>
#include <vector>

#include "k3/io/npy.hpp"
#include "moe/moe_test_util.hpp"

using namespace moe_test;
namespace moe = k3::moe;
namespace fs = std::filesystem;

namespace {

int run(std::string const& args, std::string* err = nullptr) {
  fs::path const log = fs::temp_directory_path() / "k3_route_test_stderr.txt";
  std::string cmd = std::string(K3_CLI_PATH) + " route " + args + " > /dev/null 2> " + log.string();
  int rc = std::system(cmd.c_str());
  if (err) {
    std::ifstream f(log);
    std::stringstream ss;
    ss << f.rdbuf();
    *err = ss.str();
  }
  return rc;
}

template <class T>
std::vector<T> load(fs::path const& p, std::string const& name) {
  auto a = k3::io::read_npy((p / (name + ".npy")).string());
  std::vector<T> v(static_cast<std::size_t>(a.size()));
  auto const* d = static_cast<T const*>(a.data());
  std::copy(d, d + a.size(), v.begin());
  return v;
}

}  // namespace

TEST_CASE("k3 route: histogram and exact updates, --solve, and a clear error for k >= n") {
  index_t const m = 512, n = 32, k = 4;
  fs::path const dir = fs::temp_directory_path() / ("k3_route_cli_" + std::to_string(::getpid()));
  fs::create_directories(dir / "in");
  auto s = skewed_scores(m, n, 5.0, 3);
  auto b = uniform(n, -0.05, 0.05, 4);
  k3::io::write_npy((dir / "in" / "scores.npy").string(), k3::host_view(s.data(), m, n));
  k3::io::write_npy((dir / "in" / "bias.npy").string(), k3::host_view(b.data(), n));
  std::string const io = " --in " + (dir / "in").string() + " --out ";

  moe::router_options opt;
  opt.k = k;
  routed r(m, k, n);
  auto hist = moe::qb_histogram::for_bias(cview(b), 1000);
  moe::route(k3::cpu::serial{}, r.args(cview(s, m, n), cview(b), {}, &hist), opt);
  auto bh = b;
  moe::qb_update(k3::cpu::serial{}, moe::qb_update_args<float>{.histogram = &hist, .bias = mview(bh)}, {.router = {.k = k}});
  auto be = b;
  moe::qb_exact_update(k3::cpu::serial{}, moe::qb_exact_update_args<float>{.scores = cview(s, m, n), .cutoff = cview(r.cut), .bias = mview(be)}, {.router = opt});

  REQUIRE(run(io + (dir / "h").string() + " --k 4 --threads 2") == 0);
  CHECK(load<std::int32_t>(dir / "h", "indices") == r.idx);
  CHECK(load<float>(dir / "h", "weights") == r.w);
  CHECK(load<std::int64_t>(dir / "h", "load") == r.load);
  CHECK(load<float>(dir / "h", "new_bias") == bh);

  REQUIRE(run(io + (dir / "e").string() + " --k 4 --update exact") == 0);
  CHECK(load<float>(dir / "e", "new_bias") == be);

  REQUIRE(run(io + (dir / "s").string() + " --k 4 --solve --iterations 12") == 0);
  CHECK(max_violation(load<std::int64_t>(dir / "s", "load"), m, k) < 0.1);

  std::string err;
  CHECK(run(io + (dir / "x").string() + " --k 32", &err) != 0);
  CHECK(err.find("option '--k': must be in [1, n - 1]") != std::string::npos);
  CHECK(run(io + (dir / "x").string() + " --k 4 --update median", &err) != 0);
  CHECK(err.find("histogram|exact") != std::string::npos);
  // Options the chosen mode would not read are errors, not silently ignored.
  for (auto const& opts_what : std::vector<std::pair<std::string, std::string>>{
           {" --solve --update exact", "'--update' does not apply with --solve"},
           {" --solve --bins 10", "'--bins' does not apply with --solve"},
           {" --solve --ema 0.5", "'--ema' does not apply with --solve"},
           {" --groups 4 --update histogram", "'--update' does not apply with --groups 4"},
           {" --groups 4 --topk-groups 2 --bins 8", "'--bins' does not apply with --groups 4"},
           {" --groups 4 --topk-groups 2 --ema 0.1", "'--ema' does not apply with --groups 4"},
           {" --groups 4 --topk-groups 2 --solve", "'--solve' does not apply with --groups 4"},
           {" --iterations 5", "'--iterations' applies only with --solve"},
           {" --update exact --bins 10", "'--bins' applies only to --update histogram"}}) {
    auto const& [opts, what] = opts_what;
    std::string const& label = opts;  // CAPTURE cannot name a structured binding (clang 14)
    CAPTURE(label);
    CHECK(run(io + (dir / "x").string() + " --k 4" + opts, &err) != 0);
    CHECK(err.find(what) != std::string::npos);
    CHECK(!fs::exists(dir / "x" / "indices.npy"));
  }
  // Named by the CLI option, not the library's field.
  CHECK(run(io + (dir / "x").string() + " --k 4 --groups 5", &err) != 0);
  CHECK(err.find("option '--groups': must divide n = 32") != std::string::npos);
  CHECK(run(io + (dir / "x").string() + " --k 4 --scale nan", &err) != 0);
  CHECK(err.find("option '--scale'") != std::string::npos);
  // Both scores.npy and logits.npy: ambiguous, not a silent pick.
  k3::io::write_npy((dir / "in" / "logits.npy").string(), k3::host_view(s.data(), m, n));
  CHECK(run(io + (dir / "x").string() + " --k 4", &err) != 0);
  CHECK(err.find("both scores.npy and logits.npy") != std::string::npos);
  fs::remove(dir / "in" / "logits.npy");
  // A non-finite mask entry is an error, not a real token.
  {
    std::vector<float> mk(static_cast<std::size_t>(m), 1.f);
    mk[7] = std::nanf("");
    k3::io::write_npy((dir / "in" / "mask.npy").string(), k3::host_view(mk.data(), m));
    CHECK(run(io + (dir / "x").string() + " --k 4", &err) != 0);
    CHECK(err.find("argument 'mask': non-finite value at token 7") != std::string::npos);
    fs::remove(dir / "in" / "mask.npy");
  }
  // The combinations that do apply still run.
  for (std::string const opts : {" --update exact --ema 0.5", " --bins 7 --ema 0.25", " --solve --iterations 3", " --groups 4 --topk-groups 2"})
    CHECK(run(io + (dir / "ok").string() + " --k 4" + opts) == 0);
  fs::remove_all(dir);
}
