// k3/quant/common.hpp — vocabulary shared by the block quantizers: tile shapes, scale rules,
// MX element kinds, per-block scale rules (bit-exact, scalar; the SIMD and CUDA paths call
// the same functions once per block) and argument validation.
//
// Layouts (all row-major, the shapes torchao / DeepGEMM reference code returns):
//   DeepSeek FP8   x [M, K] -> q [M, K] uint8 E4M3 codes,
//                  s [ceil(M/tr), ceil(K/tc)] float: s(i/tr, j/tc) is the decode scale
//                  (x ≈ e4m3(q) · s) of tile (tr x tc) = 1x128 activations, 128x128 weights,
//                  128x1 for the backward's re-quantised activations. Partial tiles at the
//                  bottom/right behave as if zero-padded (padding never changes amax).
//   OCP MX         x [M, K], K % 32 == 0 -> s [M, K/32] uint8 E8M0; q [M, K] uint8 for
//                  MXFP8/MXFP6 (one code per byte, FP6 in the low 6 bits), q [M, K/2] for MXFP4
//                  (two E2M1 codes per byte, even element in the low nibble).
//   NVFP4          x [M, K], K % 16 == 0 -> q [M, K/2] packed E2M1, s [M, K/16] uint8 UE4M3,
//                  plus one fp32 tensor scale g: x ≈ e2m1(q) · ue4m3(s) · g.
#pragma once
#include <cmath>
#include <cstdint>
#include <string>

#include "k3/core/error.hpp"
#include "k3/core/numeric/bfloat16.hpp"
#include "k3/core/numeric/fp4.hpp"
#include "k3/core/numeric/fp6.hpp"
#include "k3/core/numeric/fp8.hpp"
#include "k3/core/tensor_view.hpp"
#include "k3/core/validate.hpp"

namespace k3::quant {

// A DeepSeek scaling tile: rows x cols elements share one scale.
struct tile {
  index_t rows = 1, cols = 128;
  friend constexpr bool operator==(tile, tile) = default;
};
inline constexpr tile tile_1x128{1, 128};      // activations (per token, 128 channels)
inline constexpr tile tile_128x128{128, 128};  // weights (128 out x 128 in channels)
inline constexpr tile tile_128x1{128, 1};      // re-quantised activations for the backward

// DeepSeek scale format: fp32 s = max(amax, 1e-4)/448, or UE8M0: the same s rounded up to a
// power of two by bits (DeepGEMM ceil_to_ue8m0, exponent field clamped to [1, 254]), stored
// as a float that is an exact power of two.
enum class scale_format : std::uint8_t { fp32, ue8m0 };

// MX shared-exponent rule: FLOOR (OCP spec: floor(log2 amax) − emax_elem; the top binade can
// clip) or RCEIL (2^ceil(log2(amax / max_elem)), cuBLAS/TE/DeepGEMM; never clips).
enum class mx_rule : std::uint8_t { floor, rceil };

enum class mx_element : std::uint8_t { e4m3, e5m2, e3m2, e2m3, e2m1 };

// How NVFP4 scales an element before E2M1 rounding (tensor scale g, decoded block scale sb):
// reciprocal = x · ((1/g) / sb), the convention of torchao's current nvfp4_quantize and of the
// GPU kernels it matches (the default); divide = x / (g · sb), torchao's earlier form.
enum class nvfp4_rounding : std::uint8_t { reciprocal, divide };

inline constexpr index_t mx_block = 32;
inline constexpr index_t nvfp4_block = 16;
inline constexpr float deepseek_amax_floor = 1e-4f;

constexpr char const* name(mx_element e) noexcept {
  switch (e) {
    case mx_element::e4m3: return "e4m3";
    case mx_element::e5m2: return "e5m2";
    case mx_element::e3m2: return "e3m2";
    case mx_element::e2m3: return "e2m3";
    case mx_element::e2m1: return "e2m1";
  }
  return "?";
}

// Codes per byte of an MX element row: FP4 packs two.
constexpr index_t mx_code_columns(mx_element e, index_t k) noexcept { return e == mx_element::e2m1 ? k / 2 : k; }

// Calls f(format{}) with the element's format descriptor.
template <class F>
decltype(auto) visit(mx_element e, F&& f) {
  switch (e) {
    case mx_element::e4m3: return f(e4m3_format{});
    case mx_element::e5m2: return f(e5m2_format{});
    case mx_element::e3m2: return f(e3m2_format{});
    case mx_element::e2m3: return f(e2m3_format{});
    case mx_element::e2m1: break;
  }
  return f(e2m1_format{});
}

namespace detail {

// amax as the max of |x|'s bit patterns: orders non-negative floats, and NaN > Inf > finite,
// so one integer max tells both the amax and whether the block holds a non-finite value.
K3_INLINE constexpr std::uint32_t abs_bits(float x) noexcept { return k3::detail::bit_cast<std::uint32_t>(x) & 0x7FFFFFFFu; }
inline constexpr std::uint32_t nonfinite_bits = 0x7F800000u;
K3_INLINE constexpr float quiet_nan() noexcept { return k3::detail::bit_cast<float>(std::uint32_t{0x7FC00000u}); }

// float value of an input element, usable in device code (bfloat16's conversion operator
// goes through std::bit_cast, which nvcc rejects in kernels without relaxed constexpr).
K3_INLINE constexpr float to_f32(float x) noexcept { return x; }
K3_INLINE constexpr float to_f32(bfloat16 x) noexcept { return k3::detail::bit_cast<float>(std::uint32_t(x.bits) << 16); }

// ---- DeepSeek FP8 scale: decode scale s and encode multiplier 1/s for a tile's amax ------
struct fp8_scale {
  float s, inv;
};
// amax_bits from abs_bits. A non-finite tile gets s = NaN (the whole tile decodes to NaN).
K3_INLINE fp8_scale deepseek_scale(std::uint32_t amax_bits, scale_format fmt) noexcept {
  if (amax_bits >= nonfinite_bits) return {quiet_nan(), quiet_nan()};
  float amax = k3::detail::bit_cast<float>(amax_bits);
  if (amax < deepseek_amax_floor) amax = deepseek_amax_floor;
  float s = amax / 448.0f;
  if (fmt == scale_format::ue8m0) {
    std::uint8_t e = e8m0_ceil(s);
    if (e < 1) e = 1;
    if (e > 254) e = 254;
    s = decode<e8m0_format>(e);
  }
  return {s, 1.0f / s};
}

// ---- MX: E8M0 scale code and encode multiplier 2^-se --------------------------------------
struct mx_scale {
  std::uint8_t code;  // 0xFF: NaN block
  float inv;          // 2^-se; NaN for a NaN block
};
template <class F>
K3_INLINE mx_scale mx_block_scale(std::uint32_t amax_bits, mx_rule rule) noexcept {
  if (amax_bits >= nonfinite_bits) return {0xFF, quiet_nan()};
  float const amax = k3::detail::bit_cast<float>(amax_bits);
  int se;
  if (rule == mx_rule::floor) {
    se = amax_bits == 0 ? -127 : floor_log2(amax) - F::emax_elem;
  } else {
    se = static_cast<int>(e8m0_ceil(amax / decode<F>(static_cast<std::uint8_t>(F::max_code)))) - 127;
  }
  if (se < -127) se = -127;  // clamp before computing both X and the elements (microxcaling)
  return {static_cast<std::uint8_t>(se + 127), k3::detail::exp2i_float(-se)};
}

// ---- NVFP4: UE4M3 block scale code and the element scaling ----------------------------------
// Each element is scaled to the E2M1 grid (then rounded to nearest even) by one of
//   x · ((1/g) / sb)   the default: torchao's nvfp4_quantize and the GPU kernels it matches
//                      multiply by a reciprocal computed in fp32 as written, so k3 does too;
//   x / (g · sb)       torchao's earlier form, kept for checkpoints quantised with it.
// The two round differently only where x·factor lands next to an exact E2M1 tie.
// With g < 2^-122 the reciprocal factor can overflow fp32 (x · inf would turn zeros into NaN):
// such blocks use the divide form, the only finite evaluation of the same quotient.
struct nvfp4_scale {
  std::uint8_t code;  // 0x7F: NaN block
  float factor;       // the multiplier, or the divisor when `divide`
  bool divide;
};
K3_INLINE nvfp4_scale nvfp4_block_scale(std::uint32_t amax_bits, float g, nvfp4_rounding rounding) noexcept {
  if (amax_bits >= nonfinite_bits) return {0x7F, quiet_nan(), true};
  float const bs = k3::detail::bit_cast<float>(amax_bits) / 6.0f;
  float r = bs / g;
  if (r < 0x1p-6f) r = 0x1p-6f;
  if (r > 448.0f) r = 448.0f;
  std::uint8_t const c = encode<ue4m3_format>(r, saturation::finite);
  float const sb = decode<ue4m3_format>(c);
  if (rounding == nvfp4_rounding::reciprocal) {
    float const f = (1.0f / g) / sb;
    if (abs_bits(f) < nonfinite_bits) return {c, f, false};
  }
  return {c, g * sb, true};
}
K3_INLINE float nvfp4_scaled(float x, nvfp4_scale const& sc) noexcept { return sc.divide ? x / sc.factor : x * sc.factor; }

// ---- validation ----------------------------------------------------------------------------
inline index_t ceil_div(index_t a, index_t b) noexcept { return (a + b - 1) / b; }

inline void check_tile(tile t) {
  k3::detail::require(t.rows > 0 && t.cols > 0, error_kind::shape, [&] {
    return "argument 'tile': expected positive extents, got " + std::to_string(t.rows) + "x" + std::to_string(t.cols);
  });
}

inline void check_divides(char const* arg, index_t k, index_t block) {
  k3::detail::require(k % block == 0, error_kind::shape, [&] {
    return std::string("argument '") + arg + "': the last extent (" + std::to_string(k) + ") must be a multiple of the block size " +
           std::to_string(block);
  });
}

inline void check_tensor_scale(float g) {
  k3::detail::require(std::isfinite(g) && g > 0, error_kind::value, [&] {
    return "option 'tensor_scale': expected a finite positive float (k3::quant::nvfp4_tensor_scale), got " + std::to_string(g);
  });
}

template <class V>
void check_2d(char const* arg, V const& v) {
  k3::detail::check_view(arg, v);
}

// Outputs (host and CUDA entry points alike): none broadcast (a stride-0 dimension of extent > 1
// writes one address for several elements: order-dependent bytes, races between threads), none
// over an input or over the other output. See k3::detail::check_outputs_apart.
template <class Q, class S, class X>
void check_quantize_outputs(Q const& q, S const& s, X const& x) {
  k3::detail::check_outputs_apart(::k3::detail::named_views("q", q, "scales", s), ::k3::detail::named_views("x", x));
}

template <class Y, class Q, class S>
void check_dequantize_output(Y const& y, Q const& q, S const& s) {
  k3::detail::check_outputs_apart(::k3::detail::named_views("y", y), ::k3::detail::named_views("q", q, "scales", s));
}

template <class C, class QA, class SA, class QB, class SB>
void check_gemm_output(C const& c, QA const& qa, SA const& sa, QB const& qb, SB const& sb) {
  k3::detail::check_outputs_apart(::k3::detail::named_views("c", c),
                                  ::k3::detail::named_views("a_q", qa, "a_scales", sa, "b_q", qb, "b_scales", sb));
}

}  // namespace detail

// The [rows, last] matrix of a tensor of any rank >= 1, for quantising along the last axis.
// The leading dimensions must be collapsible (each stride = next stride x next extent).
template <class T, std::size_t R>
tensor_view<T, 2> as_matrix(tensor_view<T, R> v) {
  static_assert(R >= 1);
  if constexpr (R == 1) {
    return tensor_view<T, 2>(v.data_handle(), {1, v.extent(0)}, {v.extent(0) * v.stride(0), v.stride(0)});
  } else {
    index_t rows = 1;
    for (std::size_t r = 0; r + 1 < R; ++r) {
      rows *= v.extent(r);
      if (r + 2 < R && v.extent(r) > 1)
        k3::detail::require(v.stride(r) == v.stride(r + 1) * v.extent(r + 1), error_kind::shape, [&] {
          return "argument 'x': the leading dimensions of shape " + k3::detail::format_shape(v.extents()) + " with strides " +
                 k3::detail::format_shape(v.strides()) + " cannot be flattened into rows";
        });
    }
    return tensor_view<T, 2>(v.data_handle(), {rows, v.extent(R - 1)}, {v.stride(R - 2), v.stride(R - 1)});
  }
}

}  // namespace k3::quant
