// k3/io/npy.hpp — reading and writing NumPy .npy files (format versions 1, 2 and 3, C order).
//
// Files are untrusted input: every header field is checked, shapes are multiplied with
// overflow checks, the data length must match exactly, and each failure throws k3::error
// with one line saying what is wrong. Supported dtypes: float32 '<f4', float64 '<f8',
// bfloat16 ('<u2' as written by torch .view(torch.uint16), or '|V2'/'<V2' as written by
// ml_dtypes), int32 '<i4', int64 '<i8', uint8 '|u1' (numpy bool '|b1' reads as uint8). Big-endian
// numbers ('>f4', '>f8', '>u2', '>i4', '>i8') are byte-swapped and Fortran-order files (what
// np.save writes for a transposed matrix) are reordered on reading, so every array holds native
// little-endian numbers in C order; files are always written that way.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <fstream>
#include <iterator>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "k3/core/error.hpp"
#include "k3/core/numeric/bfloat16.hpp"
#include "k3/core/tensor_view.hpp"

namespace k3::io {

enum class dtype : std::uint8_t { float32, float64, bfloat16, uint16, int32, int64, uint8 };

constexpr std::size_t dtype_size(dtype t) noexcept {
  switch (t) {
    case dtype::float32: return 4;
    case dtype::float64: return 8;
    case dtype::bfloat16: return 2;
    case dtype::uint16: return 2;
    case dtype::int32: return 4;
    case dtype::int64: return 8;
    case dtype::uint8: return 1;
  }
  return 0;
}

constexpr char const* dtype_name(dtype t) noexcept {
  switch (t) {
    case dtype::float32: return "float32";
    case dtype::float64: return "float64";
    case dtype::bfloat16: return "bfloat16";
    case dtype::uint16: return "uint16";
    case dtype::int32: return "int32";
    case dtype::int64: return "int64";
    case dtype::uint8: return "uint8";
  }
  return "?";
}

template <class T>
constexpr dtype dtype_of() noexcept {
  if constexpr (std::is_same_v<T, float>) return dtype::float32;
  else if constexpr (std::is_same_v<T, double>) return dtype::float64;
  else if constexpr (std::is_same_v<T, bfloat16>) return dtype::bfloat16;
  else if constexpr (std::is_same_v<T, std::uint16_t>) return dtype::uint16;
  else if constexpr (std::is_same_v<T, std::int32_t>) return dtype::int32;
  else if constexpr (std::is_same_v<T, std::int64_t>) return dtype::int64;
  else {
    static_assert(std::is_same_v<T, std::uint8_t>, "k3::io: unsupported .npy element type");
    return dtype::uint8;
  }
}

// An array read from a .npy file: dtype, shape and C-order data (suitably aligned).
class npy_array {
 public:
  npy_array() = default;
  npy_array(dtype t, std::vector<index_t> shape) : type_(t), shape_(std::move(shape)) {
    // At least one word, so that an array read from a file never has a null data pointer: ops
    // take a null view as an absent optional argument (h0, dht, ...), and an empty h0.npy must
    // be checked against its expected shape, not silently dropped.
    words_.resize(std::max<std::size_t>(1, (byte_size() + 7) / 8));
  }

  dtype type() const noexcept { return type_; }
  std::vector<index_t> const& shape() const noexcept { return shape_; }
  std::size_t rank() const noexcept { return shape_.size(); }
  index_t size() const noexcept {
    index_t n = 1;
    for (auto e : shape_) n *= e;
    return n;
  }
  std::size_t byte_size() const noexcept { return static_cast<std::size_t>(size()) * dtype_size(type_); }
  void* data() noexcept { return words_.data(); }
  void const* data() const noexcept { return words_.data(); }

  // A typed view; `name` is used in the error when the dtype or rank does not match.
  // bfloat16 accepts both of its on-disk spellings.
  template <class T, std::size_t Rank>
  tensor_view<T const, Rank> view(std::string_view name = "array") const& {
    check_type<T>(name);
    detail::require(shape_.size() == Rank, error_kind::shape, [&] {
      return "argument '" + std::string(name) + "': expected rank " + std::to_string(Rank) + ", got shape " +
             detail::format_shape(shape_);
    });
    array<index_t, Rank> e{};
    for (std::size_t r = 0; r < Rank; ++r) e[r] = shape_[r];
    return {static_cast<T const*>(data()), e};
  }
  template <class T, std::size_t Rank>
  tensor_view<T, Rank> view(std::string_view name = "array") & {
    auto v = std::as_const(*this).template view<T, Rank>(name);
    return {const_cast<T*>(v.data_handle()), v.extents()};
  }
  // A view into a temporary (read_npy(p).view<...>()) would dangle: keep the array in a
  // variable first.
  template <class T, std::size_t Rank>
  tensor_view<T, Rank> view(std::string_view name = "array") && = delete;

  // Element i (C order) converted to double, whatever the dtype.
  double as_double(index_t i) const noexcept {
    unsigned char const* p = static_cast<unsigned char const*>(data()) + static_cast<std::size_t>(i) * dtype_size(type_);
    switch (type_) {
      case dtype::float32: return read<float>(p);
      case dtype::float64: return read<double>(p);
      case dtype::bfloat16: return float(bfloat16::from_bits(read<std::uint16_t>(p)));
      case dtype::uint16: return read<std::uint16_t>(p);
      case dtype::int32: return read<std::int32_t>(p);
      case dtype::int64: return static_cast<double>(read<std::int64_t>(p));
      case dtype::uint8: return *p;
    }
    return 0;
  }
  // Element i of an integer array as int64 (throws for float arrays).
  std::int64_t as_int(index_t i) const {
    unsigned char const* p = static_cast<unsigned char const*>(data()) + static_cast<std::size_t>(i) * dtype_size(type_);
    switch (type_) {
      case dtype::int32: return read<std::int32_t>(p);
      case dtype::int64: return read<std::int64_t>(p);
      case dtype::uint8: return *p;
      case dtype::uint16: return read<std::uint16_t>(p);
      default: throw k3::error(error_kind::dtype, std::string("expected an integer array, got ") + dtype_name(type_));
    }
  }

  template <class T>
  void check_type(std::string_view name) const {
    constexpr dtype want = dtype_of<T>();
    bool ok = type_ == want || (want == dtype::bfloat16 && type_ == dtype::uint16);
    detail::require(ok, error_kind::dtype, [&] {
      return "argument '" + std::string(name) + "': expected dtype " + dtype_name(want) + ", got " + dtype_name(type_);
    });
  }

 private:
  template <class U>
  static U read(unsigned char const* p) noexcept {
    U u;
    std::memcpy(&u, p, sizeof(U));
    return u;
  }
  dtype type_ = dtype::float32;
  std::vector<index_t> shape_;
  std::vector<std::uint64_t> words_;  // 8-byte aligned storage for any dtype
};

namespace detail {
using ::k3::detail::format_shape;
using ::k3::detail::require;

// Parser for the header's Python dict literal. Accepts exactly what numpy writes (and
// harmless whitespace variations): string keys; values that are strings, True/False, or
// tuples of non-negative integers.
class npy_header_parser {
 public:
  explicit npy_header_parser(std::string_view s) : s_(s) {}

  void parse(std::string& descr, bool& fortran, std::vector<index_t>& shape) {
    bool have_descr = false, have_fortran = false, have_shape = false;
    skip_ws();
    expect('{');
    for (;;) {
      skip_ws();
      if (peek() == '}') { ++i_; break; }
      std::string key = parse_string();
      skip_ws();
      expect(':');
      skip_ws();
      if (key == "descr") {
        descr = parse_string();
        have_descr = true;
      } else if (key == "fortran_order") {
        fortran = parse_bool();
        have_fortran = true;
      } else if (key == "shape") {
        shape = parse_shape();
        have_shape = true;
      } else {
        fail("unknown key '" + key + "'");
      }
      skip_ws();
      if (peek() == ',') { ++i_; continue; }
      skip_ws();
      expect('}');
      break;
    }
    skip_ws();
    if (i_ != s_.size()) fail("trailing characters after the header dict");
    if (!have_descr || !have_fortran || !have_shape) fail("header dict lacks 'descr', 'fortran_order' or 'shape'");
  }

 private:
  [[noreturn]] void fail(std::string const& what) const { throw k3::error(error_kind::io, "malformed .npy header: " + what); }
  char peek() const { return i_ < s_.size() ? s_[i_] : '\0'; }
  void skip_ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "' at offset " + std::to_string(i_));
    ++i_;
  }
  std::string parse_string() {
    char q = peek();
    if (q != '\'' && q != '"') fail("expected a quoted string at offset " + std::to_string(i_));
    ++i_;
    std::size_t start = i_;
    while (i_ < s_.size() && s_[i_] != q) {
      if (s_[i_] == '\\') fail("escapes are not supported in header strings");
      ++i_;
    }
    if (i_ >= s_.size()) fail("unterminated string");
    std::string out(s_.substr(start, i_ - start));
    ++i_;
    if (out.size() > 64) fail("string too long");
    return out;
  }
  bool parse_bool() {
    if (s_.substr(i_, 4) == "True") { i_ += 4; return true; }
    if (s_.substr(i_, 5) == "False") { i_ += 5; return false; }
    fail("expected True or False");
  }
  std::vector<index_t> parse_shape() {
    std::vector<index_t> shape;
    expect('(');
    for (;;) {
      skip_ws();
      if (peek() == ')') { ++i_; break; }
      if (peek() < '0' || peek() > '9') fail("expected a non-negative integer in shape");
      std::uint64_t v = 0;
      while (peek() >= '0' && peek() <= '9') {
        v = v * 10 + static_cast<std::uint64_t>(peek() - '0');
        if (v > static_cast<std::uint64_t>(std::numeric_limits<index_t>::max() / 16)) fail("shape entry too large");
        ++i_;
      }
      if (peek() == 'L') ++i_;  // Python 2 longs
      shape.push_back(static_cast<index_t>(v));
      if (shape.size() > 32) fail("more than 32 dimensions");
      skip_ws();
      if (peek() == ',') { ++i_; continue; }
      skip_ws();
      expect(')');
      break;
    }
    return shape;
  }

  std::string_view s_;
  std::size_t i_ = 0;
};

// A descr with '>' names the same dtype as its '<' form, big-endian (one-byte and void types have
// no byte order).
inline bool big_endian_descr(std::string const& d) noexcept {
  return d == ">f4" || d == ">f8" || d == ">u2" || d == ">i4" || d == ">i8";
}

inline dtype parse_descr(std::string const& d_in) {
  std::string const d = big_endian_descr(d_in) ? "<" + d_in.substr(1) : d_in;
  if (d == "<f4") return dtype::float32;
  if (d == "<f8") return dtype::float64;
  if (d == "<u2") return dtype::uint16;
  if (d == "|V2" || d == "<V2") return dtype::bfloat16;
  if (d == "bfloat16" || d == "<bfloat16") return dtype::bfloat16;
  if (d == "<i4") return dtype::int32;
  if (d == "<i8") return dtype::int64;
  if (d == "|u1" || d == "<u1") return dtype::uint8;
  if (d == "|b1") return dtype::uint8;  // numpy bool: one byte, 0 or 1 (e.g. a token mask)
  throw k3::error(error_kind::io, "unsupported .npy dtype '" + d_in +
                  "' (supported: <f4 <f8 <u2/|V2 (bfloat16) <i4 <i8 |u1 |b1, and >f4 >f8 >u2 >i4 >i8)");
}

inline char const* descr_of(dtype t) noexcept {
  switch (t) {
    case dtype::float32: return "<f4";
    case dtype::float64: return "<f8";
    case dtype::bfloat16: return "<u2";  // what torch users get from .view(torch.uint16)
    case dtype::uint16: return "<u2";
    case dtype::int32: return "<i4";
    case dtype::int64: return "<i8";
    case dtype::uint8: return "|u1";
  }
  return "";
}

inline void byte_swap_elements(unsigned char* p, std::size_t n, std::size_t isz) noexcept {
  for (std::size_t i = 0; i < n; ++i, p += isz) std::reverse(p, p + isz);
}

// Element (i_0, ..., i_{r-1}) sits at i_0 + e_0 (i_1 + e_1 (...)) in Fortran order: walk the C
// order with an odometer and copy each element from there.
inline void fortran_to_c_order(unsigned char const* src, unsigned char* dst, std::vector<index_t> const& shape, std::size_t isz) {
  std::size_t const r = shape.size();
  std::vector<std::size_t> fstride(r), idx(r, 0);
  std::size_t n = 1;
  for (std::size_t d = 0; d < r; ++d) {
    fstride[d] = n;
    n *= static_cast<std::size_t>(shape[d]);
  }
  if (n == 0) return;
  std::size_t off = 0;  // Fortran element offset of idx
  for (std::size_t c = 0; c < n; ++c) {
    std::memcpy(dst + c * isz, src + off * isz, isz);
    for (std::size_t d = r; d-- > 0;) {  // C order: the last index runs fastest
      if (++idx[d] < static_cast<std::size_t>(shape[d])) {
        off += fstride[d];
        break;
      }
      off -= (idx[d] - 1) * fstride[d];
      idx[d] = 0;
    }
  }
}

}  // namespace detail

// Parses a whole .npy file held in memory. Throws k3::error on anything malformed.
inline npy_array parse_npy(std::span<unsigned char const> bytes) {
  constexpr unsigned char magic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
  detail::require(bytes.size() >= 10, error_kind::io, "malformed .npy file: shorter than the fixed preamble (10 bytes)");
  detail::require(std::memcmp(bytes.data(), magic, 6) == 0, error_kind::io, "malformed .npy file: bad magic string");
  unsigned const major = bytes[6];
  detail::require(major >= 1 && major <= 3, error_kind::io, [&] {
    return "unsupported .npy format version " + std::to_string(major) + "." + std::to_string(bytes[7]);
  });
  std::size_t header_len = 0, pre = 0;
  if (major == 1) {
    header_len = bytes[8] | (std::size_t(bytes[9]) << 8);
    pre = 10;
  } else {
    detail::require(bytes.size() >= 12, error_kind::io, "malformed .npy file: truncated preamble");
    header_len = bytes[8] | (std::size_t(bytes[9]) << 8) | (std::size_t(bytes[10]) << 16) | (std::size_t(bytes[11]) << 24);
    pre = 12;
  }
  detail::require(header_len <= bytes.size() - pre, error_kind::io, "malformed .npy file: header length runs past the end of the file");
  std::string_view header(reinterpret_cast<char const*>(bytes.data() + pre), header_len);
  std::string descr;
  bool fortran = false;
  std::vector<index_t> shape;
  detail::npy_header_parser(header).parse(descr, fortran, shape);
  dtype const t = detail::parse_descr(descr);

  std::size_t const avail = bytes.size() - pre - header_len;
  // Every running product must fit index_t (not just uint64): npy_array::size() and views
  // multiply the extents left to right in index_t, even when a later extent is 0.
  std::uint64_t n = 1;
  constexpr auto max_elems = static_cast<std::uint64_t>(std::numeric_limits<index_t>::max());
  for (index_t e : shape) {
    if (e != 0 && n > max_elems / static_cast<std::uint64_t>(e))
      throw k3::error(error_kind::io, "malformed .npy file: shape " + detail::format_shape(shape) + " overflows");
    n *= static_cast<std::uint64_t>(e);
  }
  // Views compute C-order strides from the right (stride(0) = product of the later extents), so
  // the extents other than 0 must multiply within index_t too: (0, 2^32, 2^32) holds nothing,
  // but a view of it would overflow computing its strides.
  std::uint64_t nz = 1;
  for (index_t e : shape) {
    if (e == 0) continue;
    if (nz > max_elems / static_cast<std::uint64_t>(e))
      throw k3::error(error_kind::io, "malformed .npy file: shape " + detail::format_shape(shape) + " overflows (its nonzero extents multiply past 2^63)");
    nz *= static_cast<std::uint64_t>(e);
  }
  std::size_t const isz = dtype_size(t);
  detail::require(n <= avail / isz && n * isz == avail, error_kind::io, [&] {
    return "malformed .npy file: shape " + detail::format_shape(shape) + " of " + dtype_name(t) + " needs " +
           (n <= std::numeric_limits<std::uint64_t>::max() / isz ? std::to_string(n * isz) : std::string("too many")) +
           " data bytes, file has " + std::to_string(avail);
  });
  npy_array a(t, shape);
  unsigned char const* payload = bytes.data() + pre + header_len;
  auto* out = static_cast<unsigned char*>(a.data());
  if (avail) {
    if (fortran && shape.size() > 1)
      detail::fortran_to_c_order(payload, out, shape, isz);
    else
      std::memcpy(out, payload, avail);
    if (detail::big_endian_descr(descr)) detail::byte_swap_elements(out, static_cast<std::size_t>(n), isz);
  }
  return a;
}

inline npy_array read_npy(std::string const& path) {
  std::ifstream f(path, std::ios::binary);
  detail::require(static_cast<bool>(f), error_kind::io, [&] { return "cannot open '" + path + "' for reading"; });
  std::vector<unsigned char> buf;
  try {  // a directory opens, then throws std::ios_base::failure on the first read
    buf.assign(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
  } catch (std::exception const& e) {
    throw k3::error(error_kind::io, "cannot read '" + path + "': " + e.what());
  }
  try {
    return parse_npy(buf);
  } catch (k3::error const& e) {
    throw k3::error(e.kind(), path + ": " + std::string(e.message()));
  }
}

// Serialises C-order data of the given dtype and shape (version 1 header, 64-byte aligned).
inline std::vector<unsigned char> format_npy(dtype t, std::vector<index_t> const& shape, void const* data) {
  std::string dict = std::string("{'descr': '") + detail::descr_of(t) + "', 'fortran_order': False, 'shape': (";
  std::uint64_t n = 1;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    detail::require(shape[i] >= 0, error_kind::shape, "format_npy: negative extent");
    dict += std::to_string(shape[i]);
    if (shape.size() == 1 || i + 1 < shape.size()) dict += ",";
    if (i + 1 < shape.size()) dict += " ";
    n *= static_cast<std::uint64_t>(shape[i]);
  }
  dict += "), }";
  std::size_t total = 10 + dict.size() + 1;
  std::size_t pad = (64 - total % 64) % 64;
  dict.append(pad, ' ');
  dict += '\n';
  std::vector<unsigned char> out;
  std::size_t const bytes = static_cast<std::size_t>(n) * dtype_size(t);
  out.reserve(10 + dict.size() + bytes);
  unsigned char const pre[8] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
  out.insert(out.end(), pre, pre + 8);
  out.push_back(static_cast<unsigned char>(dict.size() & 0xff));
  out.push_back(static_cast<unsigned char>(dict.size() >> 8));
  out.insert(out.end(), dict.begin(), dict.end());
  auto const* p = static_cast<unsigned char const*>(data);
  if (bytes) out.insert(out.end(), p, p + bytes);
  return out;
}

inline void write_npy(std::string const& path, dtype t, std::vector<index_t> const& shape, void const* data) {
  auto buf = format_npy(t, shape, data);
  std::ofstream f(path, std::ios::binary);
  detail::require(static_cast<bool>(f), error_kind::io, [&] { return "cannot open '" + path + "' for writing"; });
  f.write(reinterpret_cast<char const*>(buf.data()), static_cast<std::streamsize>(buf.size()));
  detail::require(static_cast<bool>(f), error_kind::io, [&] { return "failed writing '" + path + "'"; });
}

// Writes any host view (strided views are gathered into C order first).
template <class T, std::size_t Rank>
void write_npy(std::string const& path, tensor_view<T, Rank> v) {
  using U = std::remove_const_t<T>;
  std::vector<index_t> shape(Rank);
  for (std::size_t r = 0; r < Rank; ++r) shape[r] = v.extent(r);
  if (v.is_contiguous()) {
    write_npy(path, dtype_of<U>(), shape, v.data_handle());
    return;
  }
  std::vector<U> tmp(static_cast<std::size_t>(v.size()));
  array<index_t, Rank> idx{};
  for (std::size_t i = 0; i < tmp.size(); ++i) {
    tmp[i] = v[idx];
    for (std::size_t r = Rank; r-- > 0;) {
      if (++idx[r] < v.extent(r)) break;
      idx[r] = 0;
    }
  }
  write_npy(path, dtype_of<U>(), shape, tmp.data());
}

}  // namespace k3::io
