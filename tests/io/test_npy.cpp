#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
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
  auto u2_array = k3::io::parse_npy(u2);
  CHECK_NOTHROW(u2_array.view<k3::bfloat16, 1>("x"));
}

namespace {
template <class T>
std::vector<unsigned char> with_payload(std::string const& dict, std::vector<T> const& values, bool big_endian) {
  auto f = make_file(dict, values.size() * sizeof(T));
  auto* p = f.data() + f.size() - values.size() * sizeof(T);
  std::memcpy(p, values.data(), values.size() * sizeof(T));
  if (big_endian)
    for (std::size_t i = 0; i < values.size(); ++i) std::reverse(p + i * sizeof(T), p + (i + 1) * sizeof(T));
  return f;
}
}  // namespace

TEST_CASE("Fortran-order files are read into C order, big-endian numbers into native ones") {
  // A 2 x 3 x 4 array whose element (i, j, l) is 100 i + 10 j + l, stored column-major
  // (the first index fastest), as np.save writes np.asfortranarray(a) or a transposed matrix.
  std::vector<double> fo;
  for (int l = 0; l < 4; ++l)
    for (int j = 0; j < 3; ++j)
      for (int i = 0; i < 2; ++i) fo.push_back(100.0 * i + 10.0 * j + l);
  for (bool be : {false, true}) {
    INFO("big-endian " << be);
    auto a = k3::io::parse_npy(with_payload(std::string("{'descr': '") + (be ? ">f8" : "<f8") +
                                                "', 'fortran_order': True, 'shape': (2, 3, 4), }",
                                            fo, be));
    CHECK(a.shape() == std::vector<k3::index_t>{2, 3, 4});
    auto v = a.view<double, 3>("x");
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 3; ++j)
        for (int l = 0; l < 4; ++l) CHECK(v(i, j, l) == 100.0 * i + 10.0 * j + l);
  }
  // Every big-endian dtype, C order; a Fortran-order vector and an empty Fortran matrix.
  auto f4 = k3::io::parse_npy(with_payload("{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }", std::vector<float>{1.5f, -3.25f}, true));
  CHECK(f4.view<float, 1>("x")(1) == -3.25f);
  auto i4 = k3::io::parse_npy(with_payload("{'descr': '>i4', 'fortran_order': False, 'shape': (2,), }", std::vector<std::int32_t>{7, -70000}, true));
  CHECK(i4.as_int(1) == -70000);
  auto i8 = k3::io::parse_npy(with_payload("{'descr': '>i8', 'fortran_order': True, 'shape': (2,), }", std::vector<std::int64_t>{-5, std::int64_t(1) << 40}, true));
  CHECK(i8.as_int(0) == -5);
  CHECK(i8.as_int(1) == (std::int64_t(1) << 40));
  auto u2 = k3::io::parse_npy(with_payload("{'descr': '>u2', 'fortran_order': False, 'shape': (1,), }", std::vector<std::uint16_t>{0x3fc0}, true));
  CHECK(u2.view<k3::bfloat16, 1>("x")(0) == k3::bfloat16(1.5f));
  auto empty = k3::io::parse_npy(make_file("{'descr': '<f4', 'fortran_order': True, 'shape': (0, 3), }", 0));
  CHECK(empty.size() == 0);
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
  auto big_complex = make_file("{'descr': '>c8', 'fortran_order': False, 'shape': (1,), }", 8);
  CHECK(error_of(big_complex).find("unsupported .npy dtype '>c8'") != std::string::npos);
  auto fortran_short = make_file("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", 20);
  CHECK(error_of(fortran_short).find("needs 24 data bytes, file has 20") != std::string::npos);
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

TEST_CASE("regression: running shape products must fit int64 even when a later extent is 0") {
  // 2^32 * 2^31 fits uint64 but not int64; npy_array::size() multiplies in int64 (UBSan
  // reported signed overflow before the fix).
  auto f = make_file("{'descr': '<f8', 'fortran_order': False, 'shape': (4294967296, 2147483648, 0), }", 0);
  CHECK(error_of(f).find("overflows") != std::string::npos);
  // A zero-size array whose nonzero extents multiply within int64 is fine.
  auto ok = make_file("{'descr': '<f8', 'fortran_order': False, 'shape': (0, 1099511627776, 4096), }", 0);
  auto a = k3::io::parse_npy(ok);
  CHECK(a.size() == 0);
  CHECK(a.shape() == std::vector<k3::index_t>{0, 1099511627776, 4096});
  auto first = make_file("{'descr': '<f8', 'fortran_order': False, 'shape': (4294967296, 0, 2147483647), }", 0);
  CHECK(k3::io::parse_npy(first).size() == 0);
}

TEST_CASE("regression: the nonzero extents of an empty array must multiply within int64 (view strides)") {
  // (0, 2^32, 2^32) passed (its running products are 0) and a view of it overflowed computing
  // stride(0) = 2^32 * 2^32 (UBSan in k3 kda/attnres on such a file).
  for (char const* shape : {"(0, 4294967296, 4294967296)", "(4294967296, 0, 4294967296)", "(4294967296, 4294967296, 0)"}) {
    auto f = make_file(std::string("{'descr': '<f4', 'fortran_order': False, 'shape': ") + shape + ", }", 0);
    CHECK(error_of(f).find("overflows") != std::string::npos);
  }
}

TEST_CASE("regression: an empty array read from a file has a non-null data pointer") {
  // Ops read a null view as an absent optional argument; k3 kda/dplr silently dropped an
  // h0.npy or dht.npy of shape [0, ...] instead of reporting its wrong shape.
  for (char const* shape : {"(0,)", "(0, 2, 3, 4)", "(2, 0)", "()"}) {
    auto f = make_file(std::string("{'descr': '<f4', 'fortran_order': False, 'shape': ") + shape + ", }",
                       std::string(shape) == "()" ? 4 : 0);
    auto a = k3::io::parse_npy(f);
    CHECK(a.data() != nullptr);
  }
  auto f = make_file("{'descr': '<f4', 'fortran_order': False, 'shape': (0, 2, 3, 4), }", 0);
  auto a = k3::io::parse_npy(f);
  auto v = a.view<float, 4>("h0");
  CHECK(v.data_handle() != nullptr);
  CHECK(v.extent(0) == 0);
  CHECK(v.extent(3) == 4);
}

TEST_CASE("regression: reading a directory is a k3::error naming the path") {
  // It threw std::ios_base::failure ("basic_filebuf::underflow error"), naming no file.
  auto dir = std::filesystem::temp_directory_path() / "k3_npy_test_dir.npy";
  std::filesystem::create_directories(dir);
  CHECK_THROWS_WITH_AS(k3::io::read_npy(dir.string()), doctest::Contains("k3_npy_test_dir.npy"), k3::error);
  std::filesystem::remove(dir);
}

TEST_CASE("numpy bool arrays read as uint8 (a token mask saved as bool)") {
  auto f = make_file("{'descr': '|b1', 'fortran_order': False, 'shape': (3,), }", 3);
  f[f.size() - 2] = 1;
  auto a = k3::io::parse_npy(f);
  CHECK(a.type() == k3::io::dtype::uint8);
  CHECK(a.as_int(0) == 0);
  CHECK(a.as_int(1) == 1);
  CHECK(a.as_double(1) == 1.0);
}

TEST_CASE("more malformed headers: each gives its own message") {
  auto err = [](std::string const& dict, std::size_t bytes = 4) { return error_of(make_file(dict, bytes)); };
  CHECK(err("{'descr': '<f4, 'fortran_order': False, 'shape': (1,), }").find("malformed .npy header") != std::string::npos);
  CHECK(err("{'descr': '<f4', 'fortran_order': Maybe, 'shape': (1,), }").find("True or False") != std::string::npos);
  CHECK(err("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), 'x': 1}").find("unknown key 'x'") != std::string::npos);
  CHECK(err("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), } junk").find("trailing") != std::string::npos);
  CHECK(err("{'descr': 'a\\'b', 'fortran_order': False, 'shape': (1,), }").find("escapes") != std::string::npos);
  CHECK(err("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,), }").find("too large") !=
        std::string::npos);
  std::string many = "{'descr': '<f4', 'fortran_order': False, 'shape': (";
  for (int i = 0; i < 33; ++i) many += "1,";
  many += "), }";
  CHECK(err(many).find("32 dimensions") != std::string::npos);
  CHECK(err("{'descr': '" + std::string(70, 'f') + "', 'fortran_order': False, 'shape': (1,), }").find("too long") !=
        std::string::npos);
  CHECK(err("{'descr': '<f4', 'fortran_order': False, 'shape': (1, 2 }").find("expected ')'") != std::string::npos);
  CHECK(err("['descr']").find("expected '{'") != std::string::npos);
  // Too much data is as wrong as too little.
  CHECK(err("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", 8).find("needs 4 data bytes, file has 8") !=
        std::string::npos);
  // Version 2 needs a 4-byte header length.
  std::vector<unsigned char> v2 = {0x93, 'N', 'U', 'M', 'P', 'Y', 2, 0, 10, 0};
  CHECK(error_of(v2).find("truncated preamble") != std::string::npos);
}

TEST_CASE("accepted spellings: Python 2 longs, whitespace, key order, one-element tuples") {
  auto a = k3::io::parse_npy(make_file("{ 'shape' : (2L, 3L) , 'fortran_order':False,\"descr\":'<i4' }", 24));
  CHECK(a.type() == k3::io::dtype::int32);
  CHECK(a.shape() == std::vector<k3::index_t>{2, 3});
  auto u1 = k3::io::parse_npy(make_file("{'descr': '<u1', 'fortran_order': False, 'shape': (3,)}", 3));
  CHECK(u1.type() == k3::io::dtype::uint8);
}

TEST_CASE("as_int refuses float arrays and as_double reads every dtype") {
  std::vector<std::uint16_t> bits = {0x3f80, 0xc020};  // bfloat16 1.0, -2.5
  auto b = k3::io::parse_npy(k3::io::format_npy(k3::io::dtype::bfloat16, {2}, bits.data()));
  CHECK(b.type() == k3::io::dtype::uint16);  // written as <u2, read back as its bits
  CHECK(b.view<k3::bfloat16, 1>("w")(1) == k3::bfloat16(-2.5f));
  std::vector<std::uint8_t> u8 = {200, 7};
  auto c = k3::io::parse_npy(k3::io::format_npy(k3::io::dtype::uint8, {2}, u8.data()));
  CHECK(c.as_double(0) == 200.0);
  CHECK(c.as_int(1) == 7);
  std::vector<float> f = {0.5f};
  auto d = k3::io::parse_npy(k3::io::format_npy(k3::io::dtype::float32, {1}, f.data()));
  CHECK_THROWS_WITH_AS(d.as_int(0), doctest::Contains("expected an integer array, got float32"), k3::error);
}

TEST_CASE("write_npy gathers strided views and read_npy names the file in errors") {
  std::string const dir = "test_npy_tmp";
  std::vector<double> m = {0, 1, 2, 3, 4, 5};
  auto col = k3::host_view(m.data(), 2, 3).slice(1, 2);  // {2, 5}
  k3::io::write_npy(dir + "_col.npy", col);
  auto a = k3::io::read_npy(dir + "_col.npy");
  CHECK(a.shape() == std::vector<k3::index_t>{2});
  CHECK(a.as_double(0) == 2.0);
  CHECK(a.as_double(1) == 5.0);
  // The header is padded so that the data starts on a 64-byte boundary (numpy's rule).
  auto bytes = k3::io::format_npy(k3::io::dtype::float64, {2}, m.data());
  CHECK((bytes.size() - 16) % 64 == 0);
  std::remove((dir + "_col.npy").c_str());
  CHECK_THROWS_WITH_AS(k3::io::read_npy(dir + "_missing.npy"), doctest::Contains("test_npy_tmp_missing.npy"), k3::error);
  {
    std::ofstream bad(dir + "_bad.npy", std::ios::binary);
    bad << "not a numpy file";
  }
  CHECK_THROWS_WITH_AS(k3::io::read_npy(dir + "_bad.npy"), doctest::Contains("test_npy_tmp_bad.npy: malformed"), k3::error);
  std::remove((dir + "_bad.npy").c_str());
}

static_assert(k3::io::dtype_size(k3::io::dtype::bfloat16) == 2);
static_assert(k3::io::dtype_size(k3::io::dtype::int64) == 8);
static_assert(k3::io::dtype_of<float>() == k3::io::dtype::float32);
static_assert(k3::io::dtype_of<k3::bfloat16>() == k3::io::dtype::bfloat16);

// A view into a temporary npy_array would dangle, so asking for one does not compile.
template <class A>
concept can_view_rvalue = requires(A&& a) { static_cast<A&&>(a).template view<float, 1>("x"); };
template <class A>
concept can_view_lvalue = requires(A& a) { a.template view<float, 1>("x"); };
static_assert(!can_view_rvalue<k3::io::npy_array>);
static_assert(can_view_lvalue<k3::io::npy_array>);
static_assert(can_view_lvalue<k3::io::npy_array const>);
static_assert(std::is_same_v<decltype(std::declval<k3::io::npy_array const&>().view<float, 2>("x")),
                             k3::tensor_view<float const, 2>>);
static_assert(std::is_same_v<decltype(std::declval<k3::io::npy_array&>().view<float, 2>("x")), k3::tensor_view<float, 2>>);
