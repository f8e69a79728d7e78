// Helper for crosscheck_ml_dtypes.py: encodes every float of IN/x.npy (float32, 1-D) to each
// element format in both saturation modes, and writes the decode table of each format.
//   encode_tool DIR  ->  DIR/codes_<fmt>_<finite|none>.npy (uint8), DIR/decode_<fmt>.npy (float32)
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "k3/core/numeric/fp4.hpp"
#include "k3/core/numeric/fp6.hpp"
#include "k3/core/numeric/fp8.hpp"
#include "k3/io/npy.hpp"

namespace {

template <class F>
void run(std::string const& dir, k3::tensor_view<float const, 1> x) {
  for (auto s : {k3::saturation::finite, k3::saturation::none}) {
    std::vector<std::uint8_t> c(static_cast<std::size_t>(x.extent(0)));
    for (k3::index_t i = 0; i < x.extent(0); ++i) c[static_cast<std::size_t>(i)] = k3::encode<F>(x(i), s);
    k3::io::write_npy(dir + "/codes_" + F::name + (s == k3::saturation::finite ? "_finite" : "_none") + ".npy",
                      k3::host_view(c.data(), x.extent(0)));
  }
  std::vector<float> table(F::codes);
  for (unsigned i = 0; i < F::codes; ++i) table[i] = k3::decode<F>(static_cast<std::uint8_t>(i));
  k3::io::write_npy(dir + "/decode_" + F::name + ".npy", k3::host_view(table.data(), table.size()));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: encode_tool DIR (reads DIR/x.npy)\n");
    return 2;
  }
  std::string dir = argv[1];
  auto arr = k3::io::read_npy(dir + "/x.npy");
  auto x = arr.view<float, 1>("x");
  run<k3::e4m3_format>(dir, x);
  run<k3::e5m2_format>(dir, x);
  run<k3::e3m2_format>(dir, x);
  run<k3::e2m3_format>(dir, x);
  run<k3::e2m1_format>(dir, x);
  run<k3::e8m0_format>(dir, x);
  return 0;
}
