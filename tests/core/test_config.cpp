// k3/core/config.hpp under a host compiler: the CUDA macros vanish and the rest still works.
#include <doctest/doctest.h>

#include "k3/core/config.hpp"

#if defined(K3_CUDA_COMPILER) || defined(K3_DEVICE_PASS)
#error "a host compiler must not see K3_CUDA_COMPILER / K3_DEVICE_PASS"
#endif

namespace {
K3_HD constexpr int twice(int x) { return 2 * x; }
K3_INLINE constexpr int thrice(int x) { return 3 * x; }
struct tag_t {
  constexpr int value() const { return 42; }
};
K3_GLOBAL_CONSTANT tag_t tag{};
K3_GLOBAL_CONSTANT int table[3] = {1, 4, 9};

void add(float* K3_RESTRICT out, float const* K3_RESTRICT in, int n) {
  for (int i = 0; i < n; ++i) out[i] += in[i];
}
}  // namespace

static_assert(twice(4) == 8);
static_assert(thrice(4) == 12);
static_assert(tag.value() == 42);
static_assert(table[2] == 9);

TEST_CASE("config macros: host annotations are plain C++") {
  CHECK(twice(21) == 42);
  CHECK(&tag == &tag);
  float out[3] = {1, 2, 3}, in[3] = {1, 1, 1};
  add(out, in, 3);
  CHECK(out[2] == 4.f);
}
