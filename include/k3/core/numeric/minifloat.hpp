// k3/core/numeric/minifloat.hpp — the encode/decode engine shared by every small float
// element type (FP8 E4M3/E5M2, FP6 E3M2/E2M3, FP4 E2M1, the E8M0 MX scale, the UE4M3 NVFP4
// scale). Everything is constexpr and works on bits, so decode tables and reference vectors
// can be checked with static_assert and the same code runs in CUDA kernels.
//
// Rounding: round to nearest, ties to even on the code (equivalently the mantissa LSB), with
// gradual underflow into subnormals; the one exception is E8M0, which has no mantissa: its
// ties (1.5·2^k) round up to 2^(k+1), as ml_dtypes' float8_e8m0fnu cast does.
// Inputs are encoded from double; a float input is widened first (exact), so encode(float)
// and encode(double(float)) agree by construction and double inputs are rounded only once.
//
// Saturation modes (`k3::saturation`), and which reference each matches bit for bit:
//
//  saturation::finite  == CUDA __NV_SATFINITE (cuda_fp8.h host path, and cuda_fp6.h/cuda_fp4.h
//                         cudaRoundNearest, which always saturate):
//     |x| rounding above max finite -> ±max;  ±Inf -> ±max;
//     NaN -> canonical +NaN code (E4M3/E5M2/UE4M3 0x7F, E8M0 0xFF); formats without NaN
//     (E3M2, E2M3, E2M1) -> +max (0x1F / 0x1F / 0x7), as CUDA does.
//     E8M0: zero, negatives and values below 2^-127 -> 0x00 (2^-127); overflow -> 0xFE.
//     UE4M3 (unsigned): negative x -> 0x00.
//  saturation::none    == CUDA __NV_NOSAT, and ml_dtypes' plain astype() for FP8 and E8M0:
//     overflow and ±Inf -> E4M3: sign|0x7F (NaN; E4M3 has no Inf); E5M2: ±Inf (0x7C/0xFC);
//     E8M0: 0xFF (NaN); UE4M3: 0x7F. FP6/FP4 cannot represent overflow, so they saturate in
//     this mode too (ml_dtypes does the same).
//     NaN -> canonical +NaN code 0x7F (CUDA's float path canonicalises NaN; ml_dtypes keeps
//     the NaN's sign, and gives 0x7E for E5M2: a NaN either way, bytes differ).
//     FP6/FP4 NaN -> +max like CUDA (ml_dtypes produces ±0 here).
//     E8M0: zero and negatives -> 0xFF (NaN), values below 2^-127 -> 0x00 (as ml_dtypes).
//     UE4M3: negative nonzero x -> 0x7F (NaN).
// −0 keeps its sign in every signed format.
#pragma once
#include <cstdint>

#include "k3/core/config.hpp"

namespace k3 {

enum class saturation : std::uint8_t {
  finite,  // CUDA __NV_SATFINITE: out of range and ±Inf clamp to ±max
  none,    // CUDA __NV_NOSAT / ml_dtypes cast: overflow gives Inf or NaN
};

// How a format spends its top codes.
enum class special_values : std::uint8_t {
  none,  // every code is finite (FP6, FP4)
  fn,    // "finite, NaN": the all-ones magnitude is NaN, no Inf (E4M3, UE4M3)
  ieee,  // top exponent: M == 0 Inf, M != 0 NaN (E5M2)
  e8m0,  // unsigned exponent only: 0xFF NaN, no zero, no Inf
};

namespace detail {

template <class To, class From>
K3_INLINE constexpr To bit_cast(From const& f) noexcept {
  return __builtin_bit_cast(To, f);
}

// 2^k as float for k in [-149, 127], built from bits (constexpr, exact).
K3_INLINE constexpr float exp2i_float(int k) noexcept {
  if (k >= -126) return bit_cast<float>(static_cast<std::uint32_t>(k + 127) << 23);
  return bit_cast<float>(std::uint32_t{1} << (k + 149));
}

}  // namespace detail

// Format descriptors: layout, bias, specials, and MX's emax_elem.
template <int EBits, int MBits, int Bias, bool Signed, special_values Special, int EmaxElem>
struct minifloat_format {
  static constexpr int ebits = EBits;
  static constexpr int mbits = MBits;
  static constexpr int bias = Bias;
  static constexpr bool is_signed = Signed;
  static constexpr special_values special = Special;
  static constexpr int emax_elem = EmaxElem;  // exponent of the largest normal (MX scaling)
  static constexpr int bits = (Signed ? 1 : 0) + EBits + MBits;
  static constexpr unsigned codes = 1u << bits;
  static constexpr unsigned mag_mask = (1u << (EBits + MBits)) - 1u;
  static constexpr unsigned sign_bit = Signed ? (1u << (EBits + MBits)) : 0u;
  // Largest finite magnitude code.
  static constexpr unsigned max_code = Special == special_values::fn     ? mag_mask - 1u
                                       : Special == special_values::ieee ? ((mag_mask >> MBits) << MBits) - 1u
                                       : Special == special_values::e8m0 ? 0xFEu
                                                                         : mag_mask;
  static constexpr bool has_nan = Special != special_values::none;
  static constexpr bool has_inf = Special == special_values::ieee;
  static constexpr unsigned nan_code = has_nan ? mag_mask : max_code;  // canonical (positive) NaN
  static constexpr unsigned inf_code = has_inf ? (mag_mask >> MBits) << MBits : max_code;
};

struct e4m3_format : minifloat_format<4, 3, 7, true, special_values::fn, 8> {
  static constexpr char const* name = "e4m3";
};
struct e5m2_format : minifloat_format<5, 2, 15, true, special_values::ieee, 15> {
  static constexpr char const* name = "e5m2";
};
struct e3m2_format : minifloat_format<3, 2, 3, true, special_values::none, 4> {
  static constexpr char const* name = "e3m2";
};
struct e2m3_format : minifloat_format<2, 3, 1, true, special_values::none, 2> {
  static constexpr char const* name = "e2m3";
};
struct e2m1_format : minifloat_format<2, 1, 1, true, special_values::none, 2> {
  static constexpr char const* name = "e2m1";
};
struct e8m0_format : minifloat_format<8, 0, 127, false, special_values::e8m0, 0> {
  static constexpr char const* name = "e8m0";
};
struct ue4m3_format : minifloat_format<4, 3, 7, false, special_values::fn, 8> {
  static constexpr char const* name = "ue4m3";
};

// Decodes a code (only the low F::bits bits are used) to float. Exact: every value of every
// format is a float (E8M0 0x00 = 2^-127 is an FP32 subnormal).
template <class F>
K3_INLINE constexpr float decode(std::uint8_t code) noexcept {
  unsigned c = code & (F::codes - 1u);
  constexpr float qnan = detail::bit_cast<float>(std::uint32_t{0x7FC00000u});
  constexpr float inf = detail::bit_cast<float>(std::uint32_t{0x7F800000u});
  if constexpr (F::special == special_values::e8m0) {
    return c == 0xFFu ? qnan : detail::exp2i_float(static_cast<int>(c) - 127);
  } else {
    bool const neg = (c & F::sign_bit) != 0;
    unsigned const mag = c & F::mag_mask;
    unsigned const e = mag >> F::mbits, m = mag & ((1u << F::mbits) - 1u);
    float v = 0.0f;
    if (F::special == special_values::fn && mag == F::mag_mask) {
      v = qnan;
    } else if (F::special == special_values::ieee && e == (F::mag_mask >> F::mbits)) {
      v = m == 0 ? inf : qnan;
    } else if (e == 0) {
      v = static_cast<float>(m) * detail::exp2i_float(1 - F::bias - F::mbits);
    } else {
      v = detail::bit_cast<float>((static_cast<std::uint32_t>(static_cast<int>(e) - F::bias + 127) << 23) |
                                  (static_cast<std::uint32_t>(m) << (23 - F::mbits)));
    }
    return neg ? -v : v;
  }
}

// Encodes x with the rounding and saturation rules in the header comment.
template <class F>
K3_INLINE constexpr std::uint8_t encode(double x, saturation sat = saturation::finite) noexcept {
  std::uint64_t const u = detail::bit_cast<std::uint64_t>(x);
  bool const neg = (u >> 63) != 0;
  std::uint64_t const a = u & 0x7FFFFFFFFFFFFFFFull;
  constexpr std::uint64_t inf_bits = 0x7FF0000000000000ull;
  unsigned const sign = neg ? F::sign_bit : 0u;
  auto overflow = [&]() constexpr -> std::uint8_t {
    if constexpr (F::special == special_values::e8m0) {
      return static_cast<std::uint8_t>(sat == saturation::finite ? F::max_code : F::nan_code);
    } else if constexpr (!F::is_signed) {  // UE4M3: a negative overflow is still negative
      if (neg) return static_cast<std::uint8_t>(sat == saturation::finite ? 0u : F::nan_code);
      return static_cast<std::uint8_t>(sat == saturation::finite ? F::max_code : F::nan_code);
    } else {
      if (sat == saturation::finite) return static_cast<std::uint8_t>(sign | F::max_code);
      if constexpr (F::special == special_values::fn) return static_cast<std::uint8_t>(sign | F::nan_code);
      if constexpr (F::special == special_values::ieee) return static_cast<std::uint8_t>(sign | F::inf_code);
      return static_cast<std::uint8_t>(sign | F::max_code);  // no Inf/NaN to overflow into
    }
  };
  if (a > inf_bits) return static_cast<std::uint8_t>(F::nan_code);  // NaN
  if (a == inf_bits) return overflow();

  if constexpr (F::special == special_values::e8m0) {
    if (a == 0 || neg) return static_cast<std::uint8_t>(sat == saturation::finite ? 0u : F::nan_code);
  } else if constexpr (!F::is_signed) {
    if (neg && a != 0) return static_cast<std::uint8_t>(sat == saturation::finite ? 0u : F::nan_code);
  }

  int const exp_field = static_cast<int>(a >> 52);
  std::uint64_t const mant = a & 0x000FFFFFFFFFFFFFull;
  if (exp_field == 0) return static_cast<std::uint8_t>(F::is_signed ? sign : 0u);  // 0 or a double subnormal
  // Target biased exponent; E8M0's exponent field starts at 0, the others' normals at 1.
  constexpr int min_normal_field = F::special == special_values::e8m0 ? 0 : 1;
  int const et = exp_field - 1023 + F::bias;
  std::uint64_t code = 0, rem = 0, half = 0;
  if (et >= min_normal_field) {
    int const shift = 52 - F::mbits;
    code = (static_cast<std::uint64_t>(et) << F::mbits) + (mant >> shift);
    rem = mant & ((std::uint64_t{1} << shift) - 1u);
    half = std::uint64_t{1} << (shift - 1);
  } else {
    if constexpr (F::special == special_values::e8m0) return 0u;  // below 2^-127 (ml_dtypes: 0x00)
    int const shift = 52 - F::mbits + (1 - et);
    if (shift > 53) return static_cast<std::uint8_t>(sign);  // below half the smallest subnormal
    std::uint64_t const full = mant | (std::uint64_t{1} << 52);
    code = full >> shift;
    rem = full & ((std::uint64_t{1} << shift) - 1u);
    half = std::uint64_t{1} << (shift - 1);
  }
  bool const tie_up = F::special == special_values::e8m0 ? true : (code & 1u) != 0;
  if (rem > half || (rem == half && tie_up)) ++code;
  if (code > F::max_code) return overflow();
  return static_cast<std::uint8_t>(sign | static_cast<unsigned>(code));
}

template <class F>
K3_INLINE constexpr std::uint8_t encode(float x, saturation sat = saturation::finite) noexcept {
  return encode<F>(static_cast<double>(x), sat);
}

template <class F>
K3_INLINE constexpr bool is_nan_code(std::uint8_t code) noexcept {
  unsigned const c = code & (F::codes - 1u);
  if constexpr (F::special == special_values::e8m0) return c == 0xFFu;
  if constexpr (F::special == special_values::fn) return (c & F::mag_mask) == F::mag_mask;
  if constexpr (F::special == special_values::ieee) return (c & F::mag_mask) > F::inf_code;
  return false;
}

// A storage type holding one code in a byte. Arithmetic goes through float.
template <class F>
struct minifloat {
  using format = F;
  std::uint8_t bits = 0;

  minifloat() = default;
  // Converting constructors saturate (as CUDA's __nv_fp8_e4m3 constructors do).
  K3_INLINE constexpr explicit minifloat(float f, saturation s = saturation::finite) noexcept : bits(encode<F>(f, s)) {}
  K3_INLINE constexpr explicit minifloat(double d, saturation s = saturation::finite) noexcept : bits(encode<F>(d, s)) {}

  K3_INLINE static constexpr minifloat from_bits(std::uint8_t b) noexcept {
    minifloat r;
    r.bits = static_cast<std::uint8_t>(b & (F::codes - 1u));
    return r;
  }
  K3_INLINE constexpr operator float() const noexcept { return decode<F>(bits); }
  K3_INLINE constexpr bool is_nan() const noexcept { return is_nan_code<F>(bits); }

  // numeric_limits-style constants (ml_dtypes' NumericLimits names).
  K3_INLINE static constexpr float max() noexcept { return decode<F>(static_cast<std::uint8_t>(F::max_code)); }
  K3_INLINE static constexpr float lowest() noexcept {
    return F::is_signed ? -max() : decode<F>(0);
  }
  K3_INLINE static constexpr float min_normal() noexcept {
    return decode<F>(static_cast<std::uint8_t>(F::special == special_values::e8m0 ? 0u : (1u << F::mbits)));
  }
  K3_INLINE static constexpr float denorm_min() noexcept {
    return decode<F>(static_cast<std::uint8_t>(F::special == special_values::e8m0 ? 0u : 1u));
  }
  K3_INLINE static constexpr float epsilon() noexcept { return detail::exp2i_float(-F::mbits); }
  static constexpr bool has_infinity = F::has_inf;
  static constexpr bool has_quiet_nan = F::has_nan;

  friend K3_INLINE constexpr bool operator==(minifloat a, minifloat b) noexcept { return float(a) == float(b); }
};

}  // namespace k3
