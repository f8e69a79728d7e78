// k3/core/numeric/fp6.hpp — the OCP MX 6-bit element types E3M2 (max 28) and E2M3 (max 7.5).
// No Inf, no NaN; one code per byte in the low 6 bits (k3 stores MXFP6 unpacked). Rounding,
// saturation and NaN rules are in minifloat.hpp.
#pragma once
#include "k3/core/numeric/minifloat.hpp"

namespace k3 {

using e3m2 = minifloat<e3m2_format>;
using e2m3 = minifloat<e2m3_format>;

}  // namespace k3
