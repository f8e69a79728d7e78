// k3/backend/cuda/arch/mma_sm80.cuh — the warp-level tensor-core instructions k3's kernels use
// (sm_80 and later, so sm_90 too), one wrapper each: on a GPU the PTX instruction itself, on
// k3's SIMT host runtime the same warp-collective semantics computed from the lanes' fragments
// (which lane holds which element is the PTX ISA's, pinned by tests/backend/cuda/test_mma.cu).
//
//   mma_m16n8k16_bf16(d, a, b, c)   D[16x8] = A[16x16] B[16x8] + C, bf16 inputs, f32 accumulation
//   ldmatrix_x4<trans>(r, row)      four 8x8 b16 matrices from shared memory into fragments
//
// Fragments (PTX "mma.m16n8k16" with .row.col, and "ldmatrix"), lane = 4 g + t (g = lane / 4,
// t = lane % 4); each .b32 register holds two 16-bit elements, the lower column in the low half:
//   A  a[0] = A[g][2t, 2t+1]    a[1] = A[g+8][2t, 2t+1]   a[2] = A[g][2t+8, 2t+9]   a[3] = A[g+8][2t+8, 2t+9]
//   B  b[0] = B[2t, 2t+1][g]    b[1] = B[2t+8, 2t+9][g]   (B is K x N: rows are k)
//   C  c[0], c[1] = C[g][2t, 2t+1]                         c[2], c[3] = C[g+8][2t, 2t+1]
//   ldmatrix: lanes 8j .. 8j+7 give the row addresses of matrix j; r[j] = M_j[g][2t, 2t+1]
//   (with trans: M_j[2t][g] and M_j[2t+1][g]).
// Arithmetic on the host runtime: every product of two bf16 values is exact (in double); the
// sum over k and C is taken in double and rounded once to float. A GPU's tensor cores may round
// the partial sums differently (their order and intermediate width are not specified), so
// GPU results agree to a few float ulps, not bit for bit.
#pragma once
#include "k3/backend/cuda/config.cuh"
// (config.cuh first: it picks the runtime)
#include <cstdint>
#include <cstring>

#include "k3/core/error.hpp"
#include "k3/core/numeric/bfloat16.hpp"

namespace k3::cuda::arch {

// Two bf16 values as one fragment register (lo: the lower column or row).
K3_INLINE std::uint32_t pack_bf16(::k3::bfloat16 lo, ::k3::bfloat16 hi) { return std::uint32_t(lo.bits) | (std::uint32_t(hi.bits) << 16); }
K3_INLINE ::k3::bfloat16 lo_bf16(std::uint32_t r) { return ::k3::bfloat16::from_bits(static_cast<std::uint16_t>(r & 0xFFFFu)); }
K3_INLINE ::k3::bfloat16 hi_bf16(std::uint32_t r) { return ::k3::bfloat16::from_bits(static_cast<std::uint16_t>(r >> 16)); }

#if defined(K3_SIMT_RUNTIME) && !defined(__CUDACC__)
namespace detail {

// Every lane of the warp publishes v; out[l] is lane l's value (one warp barrier).
inline void gather_warp(std::uint64_t v, std::uint64_t (&out)[32]) {
  auto& s = ::k3::simt::detail::running();
  unsigned const parity = s.publish(v);
  std::uint32_t const present = s.present_lanes(parity);
  ::k3::detail::require(present == 0xFFFFFFFFu, error_kind::value, "mma/ldmatrix: every lane of the warp must take part (.sync.aligned)");
  for (unsigned l = 0; l < 32; ++l) out[l] = s.exchanged(parity, l);
}

inline float f32_of(::k3::bfloat16 x) { return static_cast<float>(x); }
inline std::uint32_t lane_id() { return (threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)) % 32u; }

}  // namespace detail
#endif

// d = A b + c for the warp's 16 x 8 tile (fragments as above). d may alias c.
K3_INLINE void mma_m16n8k16_bf16(float (&d)[4], std::uint32_t const (&a)[4], std::uint32_t const (&b)[2], float const (&c)[4]) {
#if defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
#else
  __trap();  // tensor-core bf16 needs sm_80 or later
#endif
#elif defined(K3_SIMT_RUNTIME)
  // The whole warp's A (two rounds of two registers) and B, then this lane's four outputs.
  std::uint64_t a01[32], a23[32], b01[32];
  detail::gather_warp(std::uint64_t(a[0]) | (std::uint64_t(a[1]) << 32), a01);
  detail::gather_warp(std::uint64_t(a[2]) | (std::uint64_t(a[3]) << 32), a23);
  detail::gather_warp(std::uint64_t(b[0]) | (std::uint64_t(b[1]) << 32), b01);
  float A[16][16], B[16][8];
  for (unsigned l = 0; l < 32; ++l) {
    unsigned const g = l / 4, t = l % 4;
    std::uint32_t const r[4] = {std::uint32_t(a01[l]), std::uint32_t(a01[l] >> 32), std::uint32_t(a23[l]), std::uint32_t(a23[l] >> 32)};
    for (unsigned i = 0; i < 4; ++i) {
      unsigned const row = g + 8 * (i & 1), col = 2 * t + 8 * (i >> 1);
      A[row][col] = detail::f32_of(lo_bf16(r[i]));
      A[row][col + 1] = detail::f32_of(hi_bf16(r[i]));
    }
    std::uint32_t const s[2] = {std::uint32_t(b01[l]), std::uint32_t(b01[l] >> 32)};
    for (unsigned i = 0; i < 2; ++i) {
      unsigned const k = 2 * t + 8 * i;
      B[k][g] = detail::f32_of(lo_bf16(s[i]));
      B[k + 1][g] = detail::f32_of(hi_bf16(s[i]));
    }
  }
  unsigned const lane = detail::lane_id(), g = lane / 4, t = lane % 4;
  float out[4];
  for (unsigned i = 0; i < 4; ++i) {
    unsigned const row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
    double acc = c[i];
    for (unsigned k = 0; k < 16; ++k) acc += static_cast<double>(A[row][k]) * B[k][col];  // exact products
    out[i] = static_cast<float>(acc);
  }
  for (unsigned i = 0; i < 4; ++i) d[i] = out[i];
#else
  (void)d, (void)a, (void)b, (void)c;
#endif
}

// Four 8 x 8 matrices of 16-bit elements from shared memory: this lane gives the address of
// row (lane % 8) of matrix (lane / 8), each row 16 bytes, 16-byte aligned; r[j] receives its
// fragment of matrix j (transposed with Trans).
template <bool Trans = false>
K3_INLINE void ldmatrix_x4(std::uint32_t (&r)[4], void const* row) {
#if defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 750
  auto const addr = static_cast<std::uint32_t>(__cvta_generic_to_shared(row));
  if constexpr (Trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
#else
  (void)r, (void)row;
  __trap();
#endif
#elif defined(K3_SIMT_RUNTIME)
  std::uint64_t rows[32];
  ::k3::detail::require((reinterpret_cast<std::uintptr_t>(row) & 15u) == 0, error_kind::value, "ldmatrix: a row address must be 16-byte aligned");
  detail::gather_warp(static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(row)), rows);
  unsigned const lane = detail::lane_id(), g = lane / 4, t = lane % 4;
  auto elem = [&](unsigned j, unsigned i, unsigned k) {  // M_j[i][k]
    std::uint16_t v;
    std::memcpy(&v, reinterpret_cast<unsigned char const*>(static_cast<std::uintptr_t>(rows[8 * j + i])) + 2 * k, 2);
    return std::uint32_t(v);
  };
  for (unsigned j = 0; j < 4; ++j) r[j] = Trans ? (elem(j, 2 * t, g) | (elem(j, 2 * t + 1, g) << 16)) : (elem(j, g, 2 * t) | (elem(j, g, 2 * t + 1) << 16));
#else
  (void)r, (void)row;
#endif
}

}  // namespace k3::cuda::arch
