// k3 quant / k3 dequant — block quantization of an .npy tensor and its inverse.
//
//   k3 quant   --format F [--block B] [--scale S] --in DIR --out DIR
//       reads DIR/x.npy (float32 or bfloat16, or float64 rounded to float32 first; any rank >= 1;
//       quantised along the last axis, the leading axes are rows) and writes codes.npy (uint8),
//       scales.npy, dequant.npy (float32, x's shape) and, for nvfp4, tensor_scale.npy (float32 [1]).
//   k3 dequant --format F [--block B] --in DIR --out DIR
//       reads codes.npy, scales.npy (and tensor_scale.npy for nvfp4), writes x.npy (float32).
//
// Formats: e4m3 with --block 1x128 (default) | 128x128 | 128x1 and --scale fp32 (default) |
// ue8m0 is DeepSeek-V3's FP8 (scales.npy float32 [ceil(rows/tr), ceil(K/tc)]);
// mxfp8 (E4M3), mxfp8_e5m2, mxfp6 (E3M2), mxfp6_e2m3, mxfp4 (E2M1), or an element name
// e4m3|e5m2|e3m2|e2m3|e2m1 with --block 32, is OCP MX with --scale floor (default) | rceil
// (scales.npy uint8 E8M0 [rows, K/32]); nvfp4 (--block 16) gives UE4M3 scales [rows, K/16].
// FP4 codes are packed two per byte (even element in the low nibble): codes.npy has K/2 columns.
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "cli.hpp"
#include "k3/backend/cpu/simd.hpp"
#include "k3/quant.hpp"

namespace {

using k3::index_t;
namespace q = k3::quant;

enum class family { deepseek, mx, nvfp4 };

struct spec {
  family fam;
  q::mx_element elem = q::mx_element::e4m3;
  q::tile tile = q::tile_1x128;
  q::scale_format ds_scale = q::scale_format::fp32;
  q::mx_rule rule = q::mx_rule::floor;
  q::nvfp4_rounding nv_rounding = q::nvfp4_rounding::reciprocal;
};

std::vector<std::string> const formats = {"e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "mxfp8", "mxfp8_e5m2", "mxfp6", "mxfp6_e2m3", "mxfp4", "nvfp4"};

spec parse(k3::cli::args const& a) {
  if (!a.has("format")) throw k3::cli::usage_error("missing --format (one of e4m3|e5m2|e3m2|e2m3|e2m1|mxfp8|mxfp8_e5m2|mxfp6|mxfp6_e2m3|mxfp4|nvfp4)");
  std::string const f = a.choice("format", formats);
  spec s{family::mx};
  if (f == "nvfp4") {
    s.fam = family::nvfp4;
    std::string const b = a.value("block", "16");
    if (b != "16") throw k3::cli::usage_error("--format nvfp4 uses --block 16, got '" + b + "'");
    if (a.has("scale") && a.value("scale") != "ue4m3") throw k3::cli::usage_error("--format nvfp4 has UE4M3 block scales (--scale ue4m3)");
    if (a.has("nvfp4-rounding"))
      s.nv_rounding = a.choice("nvfp4-rounding", {"reciprocal", "divide"}) == "divide" ? q::nvfp4_rounding::divide : q::nvfp4_rounding::reciprocal;
    return s;
  }
  if (a.has("nvfp4-rounding")) throw k3::cli::usage_error("--nvfp4-rounding applies to --format nvfp4 only, got --format " + f);
  if (f == "mxfp8" || f == "e4m3") s.elem = q::mx_element::e4m3;
  if (f == "mxfp8_e5m2" || f == "e5m2") s.elem = q::mx_element::e5m2;
  if (f == "mxfp6" || f == "e3m2") s.elem = q::mx_element::e3m2;
  if (f == "mxfp6_e2m3" || f == "e2m3") s.elem = q::mx_element::e2m3;
  if (f == "mxfp4" || f == "e2m1") s.elem = q::mx_element::e2m1;
  bool const mx_name = f.rfind("mx", 0) == 0;
  std::string const block = a.value("block", f == "e4m3" ? "1x128" : "32");
  if (block == "32") {
    s.fam = family::mx;
    // Checked for k3 dequant too (where the rule does not matter): a bad value is an error there as well.
    std::string const sc = a.value("scale", "floor");
    if (sc != "floor" && sc != "rceil") throw k3::cli::usage_error("MX scales are --scale floor|rceil, got '" + sc + "'");
    s.rule = sc == "floor" ? q::mx_rule::floor : q::mx_rule::rceil;
    return s;
  }
  if (mx_name || f != "e4m3")
    throw k3::cli::usage_error("--format " + f + " uses --block 32 (OCP MX); DeepSeek tiles (--block 1x128|128x128|128x1) are E4M3");
  s.fam = family::deepseek;
  if (block == "1x128")
    s.tile = q::tile_1x128;
  else if (block == "128x128")
    s.tile = q::tile_128x128;
  else if (block == "128x1")
    s.tile = q::tile_128x1;
  else
    throw k3::cli::usage_error("--block must be one of 1x128|128x128|128x1|32|16, got '" + block + "'");
  std::string const sc = a.value("scale", "fp32");
  if (sc != "fp32" && sc != "ue8m0") throw k3::cli::usage_error("DeepSeek FP8 scales are --scale fp32|ue8m0, got '" + sc + "'");
  s.ds_scale = sc == "fp32" ? q::scale_format::fp32 : q::scale_format::ue8m0;
  return s;
}

// rows x last view over an array of any rank >= 1.
std::pair<index_t, index_t> matrix_shape(std::vector<index_t> const& shape, char const* name) {
  if (shape.empty()) throw k3::error(k3::error_kind::shape, std::string("argument '") + name + "': expected rank >= 1, got a scalar");
  index_t rows = 1;
  for (std::size_t r = 0; r + 1 < shape.size(); ++r) rows *= shape[r];
  return {rows, shape.back()};
}

std::vector<index_t> with_last(std::vector<index_t> shape, index_t last) {
  shape.back() = last;
  return shape;
}

template <class T>
int quantize_as(k3::cli::args& a, spec const& s, k3::io::npy_array const& xa) {
  k3::cpu::threads<> be(a.threads(0));
  auto [m, k] = matrix_shape(xa.shape(), "x");
  k3::tensor_view<T const, 2> x(static_cast<T const*>(xa.data()), {m, k});
  std::vector<float> y(static_cast<std::size_t>(m * k));
  auto yv = k3::host_view(y.data(), m, k);
  // Nothing to quantise: the outputs are empty (the ops would still walk 2^34 empty rows of a
  // [2^34, 0] file). An all-zero tensor's NVFP4 tensor scale is 1.
  bool const empty = m == 0 || k == 0;
  if (s.fam == family::deepseek) {
    index_t const sr = (m + s.tile.rows - 1) / s.tile.rows, sc = (k + s.tile.cols - 1) / s.tile.cols;
    std::vector<std::uint8_t> codes(static_cast<std::size_t>(m * k));
    std::vector<float> scales(static_cast<std::size_t>(sr * sc));
    if (!empty) {
      q::fp8_quantize(be, q::fp8_quantize_args<T>{.x = x, .q = k3::host_view(codes.data(), m, k), .scales = k3::host_view(scales.data(), sr, sc)},
                      {.tile = s.tile, .format = s.ds_scale});
      q::fp8_dequantize(
          be, q::fp8_dequantize_args<float>{.q = k3::host_view(codes.data(), m, k), .scales = k3::host_view(scales.data(), sr, sc), .y = yv},
          {.tile = s.tile});
    }
    k3::io::write_npy(a.out_path("codes"), k3::io::dtype::uint8, xa.shape(), codes.data());
    a.save("scales", k3::host_view(scales.data(), sr, sc));
  } else if (s.fam == family::mx) {
    index_t const qc = q::mx_code_columns(s.elem, k);
    if (k % q::mx_block != 0)
      throw k3::error(k3::error_kind::shape, "argument 'x': MX needs the last extent (" + std::to_string(k) + ") to be a multiple of 32");
    std::vector<std::uint8_t> codes(static_cast<std::size_t>(m * qc)), scales(static_cast<std::size_t>(m * (k / 32)));
    if (!empty) {
      q::mx_quantize(be, q::mx_quantize_args<T>{.x = x, .q = k3::host_view(codes.data(), m, qc), .scales = k3::host_view(scales.data(), m, k / 32)},
                     {.element = s.elem, .rule = s.rule});
      q::mx_dequantize(
          be, q::mx_dequantize_args<float>{.q = k3::host_view(codes.data(), m, qc), .scales = k3::host_view(scales.data(), m, k / 32), .y = yv},
          {.element = s.elem});
    }
    k3::io::write_npy(a.out_path("codes"), k3::io::dtype::uint8, with_last(xa.shape(), qc), codes.data());
    k3::io::write_npy(a.out_path("scales"), k3::io::dtype::uint8, with_last(xa.shape(), k / 32), scales.data());
  } else {
    if (k % q::nvfp4_block != 0)
      throw k3::error(k3::error_kind::shape, "argument 'x': NVFP4 needs the last extent (" + std::to_string(k) + ") to be a multiple of 16");
    std::vector<std::uint8_t> codes(static_cast<std::size_t>(m * k / 2)), scales(static_cast<std::size_t>(m * (k / 16)));
    float g = empty ? 1.f : q::nvfp4_tensor_scale(be, q::nvfp4_tensor_scale_args<T>{.x = x});
    if (!empty) {
      q::nvfp4_quantize(
          be, q::nvfp4_quantize_args<T>{.x = x, .q = k3::host_view(codes.data(), m, k / 2), .scales = k3::host_view(scales.data(), m, k / 16)},
          {.tensor_scale = g, .rounding = s.nv_rounding});
      q::nvfp4_dequantize(
          be, q::nvfp4_dequantize_args<float>{.q = k3::host_view(codes.data(), m, k / 2), .scales = k3::host_view(scales.data(), m, k / 16), .y = yv},
          {.tensor_scale = g});
    }
    k3::io::write_npy(a.out_path("codes"), k3::io::dtype::uint8, with_last(xa.shape(), k / 2), codes.data());
    k3::io::write_npy(a.out_path("scales"), k3::io::dtype::uint8, with_last(xa.shape(), k / 16), scales.data());
    a.save("tensor_scale", k3::host_view(&g, 1));
  }
  k3::io::write_npy(a.out_path("dequant"), k3::io::dtype::float32, xa.shape(), y.data());
  return 0;
}

int run_quant(k3::cli::args& a) {
  spec const s = parse(a);
  a.threads(0);  // a bad --threads is reported before any input is read
  auto xa = a.load("x");
  if (xa.type() == k3::io::dtype::float32) return quantize_as<float>(a, s, xa);
  if (xa.type() == k3::io::dtype::bfloat16 || xa.type() == k3::io::dtype::uint16) return quantize_as<k3::bfloat16>(a, s, xa);
  if (xa.type() == k3::io::dtype::float64) {
    // numpy's default dtype: rounded to float32 first (the formats' scales and rounding are
    // defined on float32 values), then quantised like a float32 file.
    k3::io::npy_array f(k3::io::dtype::float32, xa.shape());
    auto const* src = static_cast<double const*>(static_cast<k3::io::npy_array const&>(xa).data());
    auto* dst = static_cast<float*>(f.data());
    for (index_t i = 0; i < xa.size(); ++i) dst[i] = static_cast<float>(src[i]);
    return quantize_as<float>(a, s, f);
  }
  throw k3::error(k3::error_kind::dtype, std::string("argument 'x': expected float32, bfloat16 or float64, got ") + k3::io::dtype_name(xa.type()));
}

int run_dequant(k3::cli::args& a) {
  spec const s = parse(a);
  k3::cpu::threads<> be(a.threads(0));
  auto ca = a.load("codes");
  auto sa = a.load("scales");
  auto [m, qc] = matrix_shape(ca.shape(), "codes");
  bool const packed = s.fam == family::nvfp4 || (s.fam == family::mx && s.elem == q::mx_element::e2m1);
  if (packed && qc > std::numeric_limits<index_t>::max() / 2)
    throw k3::error(k3::error_kind::shape, "argument 'codes': shape " + k3::format_shape(ca.shape()) + " unpacks to more elements than can be addressed");
  index_t const k = packed ? 2 * qc : qc;
  k3::cli::output_elements("x", {m, k});
  std::vector<float> y(static_cast<std::size_t>(m * k));
  auto yv = k3::host_view(y.data(), m, k);
  auto const sshape = matrix_shape(sa.shape(), "scales");
  // The library names its arguments q/s/y; check the files here so the error names them.
  if (s.fam != family::deepseek && k % (s.fam == family::mx ? q::mx_block : q::nvfp4_block) != 0)
    throw k3::error(k3::error_kind::shape, "argument 'codes': " + std::string(s.fam == family::mx ? "MX" : "NVFP4") + " codes of shape " +
                    k3::format_shape(ca.shape()) + " hold " + std::to_string(k) + " elements per row, not a multiple of " +
                    std::to_string(s.fam == family::mx ? q::mx_block : q::nvfp4_block));
  index_t const want_r = s.fam == family::deepseek ? (m + s.tile.rows - 1) / s.tile.rows : m;
  index_t const want_c = s.fam == family::deepseek ? (k + s.tile.cols - 1) / s.tile.cols : k / (s.fam == family::mx ? q::mx_block : q::nvfp4_block);
  // The shape k3 quant writes: MX/NVFP4 scales keep the codes' leading axes (or their flattened
  // [rows, blocks] form); DeepSeek scales are one [row tiles, column tiles] matrix. Another shape
  // with the same element count (e.g. leading axes in another order) is a different file.
  bool const layout_ok = s.fam == family::deepseek ? sa.rank() == 2
                                                   : (sa.rank() == 2 || sa.shape() == with_last(ca.shape(), want_c));
  if (sshape.first != want_r || sshape.second != want_c || !layout_ok)
    throw k3::error(k3::error_kind::shape, "argument 'scales': expected shape " +
                    (s.fam == family::deepseek ? k3::format_shape({want_r, want_c})
                                               : k3::format_shape(with_last(ca.shape(), want_c)) + " (or " +
                                                     k3::format_shape({want_r, want_c}) + ")") +
                    " for codes of shape " + k3::format_shape(ca.shape()) + " (" + std::to_string(m) + " rows of " + std::to_string(k) +
                    " elements), got shape " + k3::format_shape(sa.shape()));
  auto flat = [&](k3::io::npy_array const& arr, char const* name, auto tag, index_t rows, index_t cols) {
    using E = decltype(tag);
    if (arr.shape().empty()) throw k3::error(k3::error_kind::shape, std::string("argument '") + name + "': expected rank >= 1");
    auto const* p = static_cast<E const*>(arr.data());
    return k3::tensor_view<E const, 2>(p, {rows, cols});
  };
  if (ca.type() != k3::io::dtype::uint8) throw k3::error(k3::error_kind::dtype, std::string("argument 'codes': expected uint8, got ") + k3::io::dtype_name(ca.type()));
  auto cv = flat(ca, "codes", std::uint8_t{}, m, qc);
  if (s.fam == family::mx && (s.elem == q::mx_element::e3m2 || s.elem == q::mx_element::e2m3)) {
    // One FP6 code per byte in the low 6 bits: a set high bit means the file holds something else.
    auto const* c = static_cast<std::uint8_t const*>(ca.data());
    for (index_t i = 0; i < m * qc; ++i)
      if (c[i] > 0x3F)
        throw k3::error(k3::error_kind::value, "argument 'codes': FP6 codes use the low 6 bits of each byte, got " + std::to_string(c[i]) + " at flat index " +
                        std::to_string(i));
  }
  if (s.fam == family::deepseek) {
    if (sa.type() != k3::io::dtype::float32) throw k3::error(k3::error_kind::dtype, "argument 'scales': expected float32 DeepSeek scales");
    auto sv = flat(sa, "scales", float{}, sshape.first, sshape.second);
    if (m != 0 && k != 0)
      q::fp8_dequantize(be, q::fp8_dequantize_args<float>{.q = cv, .scales = sv, .y = yv}, {.tile = s.tile});  // an empty [2^34, 0] file: no row walk
  } else {
    if (sa.type() != k3::io::dtype::uint8) throw k3::error(k3::error_kind::dtype, "argument 'scales': expected uint8 E8M0/UE4M3 scales");
    auto sv = flat(sa, "scales", std::uint8_t{}, sshape.first, sshape.second);
    if (s.fam == family::mx) {
      if (m != 0 && k != 0) q::mx_dequantize(be, q::mx_dequantize_args<float>{.q = cv, .scales = sv, .y = yv}, {.element = s.elem});
    } else {
      // UE4M3 is a 7-bit code in a byte (k3 quant never sets the top bit); a set top bit would be
      // a signed E4M3 scale from elsewhere, which decoding as UE4M3 would silently make positive.
      auto const* sc = static_cast<std::uint8_t const*>(sa.data());
      for (index_t i = 0; i < sa.size(); ++i)
        if (sc[i] > 0x7F)
          throw k3::error(k3::error_kind::value, "argument 'scales': NVFP4 UE4M3 scales use the low 7 bits of each byte, got " + std::to_string(sc[i]) +
                          " at flat index " + std::to_string(i));
      auto ga = a.load("tensor_scale");
      if (ga.type() != k3::io::dtype::float32 || ga.size() != 1) throw k3::error(k3::error_kind::dtype, "argument 'tensor_scale': expected one float32");
      float const g = *static_cast<float const*>(ga.data());
      if (m != 0 && k != 0)
        q::nvfp4_dequantize(be, q::nvfp4_dequantize_args<float>{.q = cv, .scales = sv, .y = yv}, {.tensor_scale = g});
      else if (!(std::isfinite(g) && g > 0))
        q::nvfp4_dequantize(be, q::nvfp4_dequantize_args<float>{.q = cv, .scales = sv, .y = yv},
                            {.tensor_scale = g});  // the library's tensor_scale check
    }
  }
  k3::io::write_npy(a.out_path("x"), k3::io::dtype::float32, with_last(ca.shape(), k), y.data());
  return 0;
}

std::vector<k3::cli::option_spec> options() {
  return k3::cli::io_options({{"format", true, "e4m3|e5m2|e3m2|e2m3|e2m1|mxfp8|mxfp8_e5m2|mxfp6|mxfp6_e2m3|mxfp4|nvfp4"},
                              {"block", true, "1x128|128x128|128x1 (DeepSeek E4M3), 32 (MX), 16 (NVFP4)"},
                              {"scale", true, "fp32|ue8m0 (DeepSeek), floor|rceil (MX), ue4m3 (NVFP4)"},
                              {"threads", true, "worker threads (default: all hardware threads); the results do not depend on it"}});
}

std::vector<k3::cli::option_spec> quant_options() {
  auto o = options();
  o.push_back({"nvfp4-rounding", true,
               "reciprocal (default: x*((1/g)/s), torchao's current nvfp4_quantize) | divide (x/(g*s), its earlier form)"});
  return o;
}

k3::cli::registrar reg_q({"quant", "block-quantize x.npy (FP8/MX/NVFP4): codes.npy, scales.npy, dequant.npy",
                          "Quantises DIR/x.npy (float32 or bfloat16, any rank >= 1; float64 is rounded to float32 first) along its\n"
                          "last axis. Outputs codes.npy (uint8; FP4\n"
                          "packed two per byte, even element in the low nibble), scales.npy (float32 DeepSeek scales or uint8\n"
                          "E8M0/UE4M3), dequant.npy (float32) and, for nvfp4, tensor_scale.npy.",
                          quant_options(), true, run_quant});
k3::cli::registrar reg_d({"dequant", "dequantize codes.npy + scales.npy back to x.npy (float32)",
                          "The reverse of k3 quant with the same --format/--block.", options(), true, run_dequant});

}  // namespace
