// The C++ half of the numpy cross-check (npy_crosscheck.py runs both halves):
//   npy_crosscheck_writer write DIR   writes every case below with k3::io::write_npy
//   npy_crosscheck_writer check DIR   reads numpy's files of the same cases (format versions
//                                     1, 2, 3; bfloat16 as ml_dtypes' |V2 and as <u2 bits) and
//                                     checks dtype, shape and every value bit for bit, also from
//                                     numpy's Fortran-order and big-endian files.
// Values follow closed formulas that the Python half computes the same way.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "k3/io/npy.hpp"

namespace {

using k3::index_t;
using k3::io::dtype;

struct spec {
  char const* name;
  dtype type;
  std::vector<index_t> shape;
};

std::vector<spec> const& cases() {
  static std::vector<spec> const c = {
      {"f32_2d", dtype::float32, {3, 5}},   {"f64_1d", dtype::float64, {7}},      {"f64_scalar", dtype::float64, {}},
      {"bf16_3d", dtype::bfloat16, {2, 3, 4}}, {"i32_2d", dtype::int32, {4, 1}}, {"i64_1d", dtype::int64, {3}},
      {"i64_empty", dtype::int64, {0, 3}}, {"u8_1d", dtype::uint8, {10}},       {"u16_1d", dtype::uint16, {6}},
  };
  return c;
}

// The volatile keeps g++ (-std=gnu++20 contracts by default, -march=native has FMA) from
// fusing this into one rounding where numpy rounds twice.
double real_value(index_t i) {
  volatile double p = static_cast<double>(i) * 0.37;
  return p - 3.1;
}

// The expected bytes of element i.
std::vector<unsigned char> expected_bytes(dtype t, index_t n) {
  std::vector<unsigned char> out(static_cast<std::size_t>(n) * k3::io::dtype_size(t));
  for (index_t i = 0; i < n; ++i) {
    unsigned char* p = out.data() + static_cast<std::size_t>(i) * k3::io::dtype_size(t);
    auto put = [&](auto v) { std::memcpy(p, &v, sizeof v); };
    switch (t) {
      case dtype::float32: put(static_cast<float>(real_value(i))); break;
      case dtype::float64: put(real_value(i)); break;
      case dtype::bfloat16: put(k3::bfloat16(static_cast<float>(real_value(i))).bits); break;
      case dtype::int32: put(static_cast<std::int32_t>(i * 7919 - 1000)); break;
      case dtype::int64: put(static_cast<std::int64_t>(i * (std::int64_t(1) << 33) - 5)); break;
      case dtype::uint8: put(static_cast<std::uint8_t>((i * 37) % 256)); break;
      case dtype::uint16: put(static_cast<std::uint16_t>((i * 1009) % 65536)); break;
    }
  }
  return out;
}

index_t count(std::vector<index_t> const& shape) {
  index_t n = 1;
  for (auto e : shape) n *= e;
  return n;
}

int failures = 0;
void fail(std::string const& what) {
  std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  ++failures;
}

void check_file(std::string const& path, spec const& s, bool bf16_as_u2) {
  k3::io::npy_array a;
  try {
    a = k3::io::read_npy(path);
  } catch (k3::error const& e) {
    fail(path + ": " + e.what());
    return;
  }
  dtype want = s.type == dtype::bfloat16 && bf16_as_u2 ? dtype::uint16 : s.type;
  if (a.type() != want) return fail(path + ": dtype " + k3::io::dtype_name(a.type()) + ", expected " + k3::io::dtype_name(want));
  if (a.shape() != s.shape) return fail(path + ": shape " + k3::detail::format_shape(a.shape()));
  auto e = expected_bytes(s.type, count(s.shape));
  if (a.byte_size() != e.size() || (!e.empty() && std::memcmp(a.data(), e.data(), e.size()) != 0))
    return fail(path + ": values differ");
  if (s.type == dtype::bfloat16 && a.size() > 1) {  // both spellings read as bfloat16
    auto v = a.view<k3::bfloat16, 3>("x");
    if (float(v(0, 0, 1)) != float(k3::bfloat16(static_cast<float>(real_value(1))))) fail(path + ": bfloat16 view");
  }
}

void expect_rejected(std::string const& path, char const* needle) {
  try {
    k3::io::read_npy(path);
    fail(path + ": accepted, expected an error mentioning '" + needle + "'");
  } catch (k3::error const& e) {
    if (std::string(e.what()).find(needle) == std::string::npos) fail(path + ": unexpected error: " + e.what());
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s write|check DIR\n", argv[0]);
    return 2;
  }
  std::string const mode = argv[1], dir = argv[2];
  if (mode == "write") {
    for (auto const& s : cases()) {
      auto bytes = expected_bytes(s.type, count(s.shape));
      k3::io::write_npy(dir + "/" + s.name + ".npy", s.type, s.shape, bytes.data());
    }
    // A strided view is gathered into C order: column 1 of a 4 x 3 float64 matrix.
    std::vector<double> m(12);
    for (std::size_t i = 0; i < m.size(); ++i) m[i] = real_value(static_cast<index_t>(i));
    k3::io::write_npy(dir + "/f64_column.npy", k3::host_view(m.data(), 4, 3).slice(1, 1));
    return 0;
  }
  if (mode == "check") {
    for (auto const& s : cases()) {
      for (char const* v : {"v1", "v2", "v3"}) check_file(dir + "/" + s.name + "_" + v + ".npy", s, false);
      if (s.type == dtype::bfloat16) check_file(dir + "/" + s.name + "_u2.npy", s, true);
    }
    for (auto const& s : cases())  // Fortran order and big-endian numbers (bfloat16 as <u2 bits)
      for (char const* v : {"fortran", "big", "big_c"}) check_file(dir + "/" + s.name + "_" + v + ".npy", s, true);
    expect_rejected(dir + "/complex.npy", "unsupported .npy dtype");
    std::printf("%s\n", failures ? "cross-check FAILED" : "numpy-written files read correctly");
    return failures ? 1 : 0;
  }
  std::fprintf(stderr, "unknown mode '%s'\n", mode.c_str());
  return 2;
}
