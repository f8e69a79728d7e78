#include <doctest/doctest.h>

#include <cstring>
#include <string>
#include <vector>

#include "k3/io/npy.hpp"

namespace {
std::vector<unsigned char> make_file(std::string const& dict, std::size_t data_bytes, int major = 1) {
  std::vector<unsigned char> out = {0x93, 'N', 'U', 'M', 'P', 'Y', static_cast<unsigned char>(major), 0};
  std::string h = dict;
  std::size_t pre = major == 1 ? 10 : 12;
  while ((pre + h.size() + 1) % 64) h += ' ';
  h += '\n';
  out.push_back(static_cast<unsigned char>(h.size() & 0xff));
  out.push_back(static_cast<unsigned char>((h.size() >> 8) & 0xff));
  if (major != 1) {
    out.push_back(0);
    out.push_back(0);
  }
  out.insert(out.end(), h.begin(), h.end());
  out.resize(out.size() + data_bytes, 0);
  return out;
}
std::string error_of(std::vector<unsigned char> const& f) {
  try {
    k3::io::parse_npy(f);
  } catch (k3::error const& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("round trip of every supported dtype through format/parse") {
  std::vector<float> f = {1.5f, -2.f, 3.f, 4.f, 5.f, 6.f};
  auto bytes = k3::io::format_npy(k3::io::dtype::float32, {2, 3}, f.data());
  auto a = k3::io::parse_npy(bytes);
  CHECK(a.type() == k3::io::dtype::float32);
  CHECK(a.shape() == std::vector<k3::index_t>{2, 3});
  auto v = a.view<float, 2>("x");
  CHECK(v(1, 2) == 6.f);
  CHECK(v(0, 0) == 1.5f);

  std::vector<std::int64_t> i64 = {1, -2, 3};
  auto b = k3::io::parse_npy(k3::io::format_npy(k3::io::dtype::int64, {3}, i64.data()));
  CHECK(b.as_int(1) == -2);
  std::vector<double> scalar = {42.0};
  auto s = k3::io::parse_npy(k3::io::format_npy(k3::io::dtype::float64, {}, scalar.data()));
  CHECK(s.rank() == 0);
  CHECK(s.as_double(0) == 42.0);
}

TEST_CASE("versions 2 and 3 and the bfloat16 spellings") {
  auto v2 = make_file("{'descr': '<f8', 'fortran_order': False, 'shape': (2,), }", 16, 2);
  CHECK(k3::io::parse_npy(v2).size() == 2);
  auto v3 = make_file("{'descr': '|V2', 'fortran_order': False, 'shape': (4,), }", 8, 3);
  auto a = k3::io::parse_npy(v3);
  CHECK(a.type() == k3::io::dtype::bfloat16);
  CHECK_NOTHROW(a.view<k3::bfloat16, 1>("x"));
  auto u2 = make_file("{'descr': '<u2', 'fortran_order': False, 'shape': (4,), }", 8);
  CHECK_NOTHROW(k3::io::parse_npy(u2).view<k3::bfloat16, 1>("x"));
}

TEST_CASE("malformed files give clear errors") {
  CHECK(error_of({}).find("shorter") != std::string::npos);
  auto bad_magic = make_file("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", 4);
  bad_magic[1] = 'X';
  CHECK(error_of(bad_magic).find("magic") != std::string::npos);
  auto truncated = make_file("{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", 8);
  CHECK(error_of(truncated).find("needs 12 data bytes, file has 8") != std::string::npos);
  auto overflow = make_file("{'descr': '<f8', 'fortran_order': False, 'shape': (4611686018427387, 4611686018427387, 4611686018427387), }", 0);
  CHECK(error_of(overflow).find("overflow") != std::string::npos);
  auto fortran = make_file("{'descr': '<f4', 'fortran_order': True, 'shape': (1,), }", 4);
  CHECK(error_of(fortran).find("fortran_order") != std::string::npos);
  auto big_endian = make_file("{'descr': '>f4', 'fortran_order': False, 'shape': (1,), }", 4);
  CHECK(error_of(big_endian).find("big-endian") != std::string::npos);
  auto odd_dtype = make_file("{'descr': '<c8', 'fortran_order': False, 'shape': (1,), }", 8);
  CHECK(error_of(odd_dtype).find("unsupported .npy dtype") != std::string::npos);
  auto neg = make_file("{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }", 4);
  CHECK(error_of(neg).find("malformed") != std::string::npos);
  auto header_past_end = make_file("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", 4);
  header_past_end[8] = 0xff;
  header_past_end[9] = 0xff;
  CHECK(error_of(header_past_end).find("header length") != std::string::npos);
  auto missing_key = make_file("{'descr': '<f4', 'shape': (1,), }", 4);
  CHECK(error_of(missing_key).find("lacks") != std::string::npos);
  auto version = make_file("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", 4);
  version[6] = 9;
  CHECK(error_of(version).find("version") != std::string::npos);
}

TEST_CASE("typed views check dtype and rank by argument name") {
  std::vector<float> f = {1, 2};
  auto a = k3::io::parse_npy(k3::io::format_npy(k3::io::dtype::float32, {2}, f.data()));
  try {
    (void)a.view<double, 1>("beta");
    FAIL("no throw");
  } catch (k3::error const& e) {
    std::string m = e.what();
    CHECK(m.find("'beta'") != std::string::npos);
    CHECK(m.find("float64") != std::string::npos);
    CHECK(m.find("float32") != std::string::npos);
  }
  CHECK_THROWS_AS((a.view<float, 2>("beta")), k3::error);
}
