// libFuzzer target for the .npy reader: any byte string either parses or throws k3::error.
// Anything else (a crash, a sanitizer report, another exception type, a failed round trip)
// is a bug. Build: -DK3_BUILD_FUZZERS=ON with clang++; run: see tests/fuzz/CMakeLists.txt.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "k3/io/npy.hpp"

namespace {

// Reads every element through the typed accessors the library offers.
double touch(k3::io::npy_array const& a) {
  double s = 0;
  for (k3::index_t i = 0; i < a.size(); ++i) s += a.as_double(i);
  switch (a.type()) {
    case k3::io::dtype::int32:
    case k3::io::dtype::int64:
    case k3::io::dtype::uint8:
    case k3::io::dtype::uint16:
      for (k3::index_t i = 0; i < a.size(); ++i) s += static_cast<double>(a.as_int(i));
      break;
    default: break;
  }
  if (a.rank() == 1 && a.type() == k3::io::dtype::float32) s += a.view<float, 1>("x").size();
  if (a.rank() == 2 && a.type() == k3::io::dtype::bfloat16) s += a.view<k3::bfloat16, 2>("x").size();
  return s;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(std::uint8_t const* data, std::size_t size) {
  k3::io::npy_array a;
  try {
    a = k3::io::parse_npy(std::span<unsigned char const>(data, size));
  } catch (k3::error const&) {
    return 0;  // rejected with a clear error: fine
  }
  volatile double sink = touch(a);
  (void)sink;
  // What parsed must survive a write/read round trip unchanged (bfloat16 is written as <u2).
  auto bytes = k3::io::format_npy(a.type(), a.shape(), a.data());
  auto b = k3::io::parse_npy(bytes);
  bool same_type = b.type() == a.type() || (a.type() == k3::io::dtype::bfloat16 && b.type() == k3::io::dtype::uint16);
  if (!same_type || b.shape() != a.shape() || b.byte_size() != a.byte_size() ||
      (a.byte_size() && std::memcmp(a.data(), b.data(), a.byte_size()) != 0))
    __builtin_trap();
  return 0;
}
