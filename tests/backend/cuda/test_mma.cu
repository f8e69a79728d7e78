// The tensor-core wrappers of k3/backend/cuda/arch/mma_sm80.cuh: fragments written out here
// from the PTX ISA's tables (independently of the wrappers), then mma.m16n8k16 against a
// float64 product, the fragment layouts pinned by integer matrices whose products are exact,
// and ldmatrix (plain and transposed) against the element each lane must receive, also as the
// A operand of an mma. On the host runtime the results are exact; on a GPU within float ulps.
#include "k3/backend/cuda/arch/mma_sm80.cuh"
// (the wrapper's header first: config.cuh picks the runtime)
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "support/device_buffer.hpp"
#include "support/random.hpp"

namespace mma_test {

using bf = k3::bfloat16;
namespace ka = k3::cuda::arch;

template <class T>
using dbuf = k3::test::device_buffer<T>;

// B [16, 8] row-major (B[k][n] at k * 8 + n) and C [16, 8] as fragments, the mma with the A
// fragments a, this lane's part of D [16, 8] stored.
__device__ inline void mma_with(std::uint32_t const (&a)[4], bf const* B, float const* C, float* D) {
  unsigned const l = threadIdx.x, g = l / 4, t = l % 4;
  auto b_at = [&](unsigned k, unsigned n) { return B[k * 8 + n]; };
  std::uint32_t const b[2] = {ka::pack_bf16(b_at(2 * t, g), b_at(2 * t + 1, g)), ka::pack_bf16(b_at(2 * t + 8, g), b_at(2 * t + 9, g))};
  float const c[4] = {C[g * 8 + 2 * t], C[g * 8 + 2 * t + 1], C[(g + 8) * 8 + 2 * t], C[(g + 8) * 8 + 2 * t + 1]};
  float d[4];
  ka::mma_m16n8k16_bf16(d, a, b, c);
  D[g * 8 + 2 * t] = d[0];
  D[g * 8 + 2 * t + 1] = d[1];
  D[(g + 8) * 8 + 2 * t] = d[2];
  D[(g + 8) * 8 + 2 * t + 1] = d[3];
}

// A [16, 16] and D [16, 8] row-major.
K3_KERNEL void mma_kernel(bf const* A, bf const* B, float const* C, float* D) {
  unsigned const l = threadIdx.x, g = l / 4, t = l % 4;
  auto a_at = [&](unsigned r, unsigned c) { return A[r * 16 + c]; };
  std::uint32_t const a[4] = {ka::pack_bf16(a_at(g, 2 * t), a_at(g, 2 * t + 1)), ka::pack_bf16(a_at(g + 8, 2 * t), a_at(g + 8, 2 * t + 1)),
                              ka::pack_bf16(a_at(g, 2 * t + 8), a_at(g, 2 * t + 9)), ka::pack_bf16(a_at(g + 8, 2 * t + 8), a_at(g + 8, 2 * t + 9))};
  mma_with(a, B, C, D);
}

// ldmatrix_x4 from four 8 x 8 matrices M_j (M_j[i][k] = src[j * 64 + i * 8 + k]); out[l * 4 + j]
// is lane l's register j.
template <bool Trans>
K3_KERNEL void ldmatrix_kernel(std::uint16_t const* src, std::uint32_t* out) {
  alignas(16) __shared__ std::uint16_t sm[4 * 64];
  unsigned const l = threadIdx.x;
  for (unsigned i = l; i < 256; i += 32) sm[i] = src[i];
  __syncthreads();
  std::uint32_t r[4];
  ka::ldmatrix_x4<Trans>(r, &sm[(l / 8) * 64 + (l % 8) * 8]);
  for (unsigned j = 0; j < 4; ++j) out[l * 4 + j] = r[j];
}

// The A operand loaded by ldmatrix (its four 8 x 8 quarters in fragment order: rows 0-7 and
// 8-15 of columns 0-7, then of columns 8-15), B and C as in mma_kernel.
K3_KERNEL void mma_ldmatrix_kernel(bf const* A, bf const* B, float const* C, float* D) {
  alignas(16) __shared__ bf sa[16 * 16];
  unsigned const l = threadIdx.x;
  for (unsigned i = l; i < 256; i += 32) sa[i] = A[i];
  __syncthreads();
  unsigned const j = l / 8, i = l % 8;  // lane l: row i of quarter j
  std::uint32_t a[4];
  ka::ldmatrix_x4<false>(a, &sa[(i + 8 * (j & 1)) * 16 + 8 * (j >> 1)]);
  mma_with(a, B, C, D);
}

std::vector<float> run_mma(std::vector<bf> const& A, std::vector<bf> const& B, std::vector<float> const& C, bool via_ldmatrix = false) {
  dbuf<bf> dA(A), dB(B);
  dbuf<float> dC(C), dD(std::vector<float>(128, -1.f));
  if (via_ldmatrix)
    k3::cuda::launch_kernel(mma_ldmatrix_kernel, {dim3(1), dim3(32)}, dA.p, dB.p, dC.p, dD.p);
  else
    k3::cuda::launch_kernel(mma_kernel, {dim3(1), dim3(32)}, dA.p, dB.p, dC.p, dD.p);
  K3_CUDA_CHECK(cudaGetLastError());
  K3_CUDA_CHECK(cudaDeviceSynchronize());
  return dD.get();
}

bool on_host_runtime() {
#if defined(K3_SIMT_RUNTIME)
  return true;
#else
  return false;
#endif
}

}  // namespace mma_test

using namespace mma_test;

TEST_CASE("mma_m16n8k16_bf16: D = A B + C against a float64 product (exact on the host runtime)") {
  for (unsigned seed : {1u, 2u, 3u}) {
    CAPTURE(seed);
    auto const ga = k3::test::gaussian(256, seed, 1.0), gb = k3::test::gaussian(128, seed + 10, 1.0), gc = k3::test::gaussian(128, seed + 20, 4.0);
    std::vector<bf> A(256), B(128);
    std::vector<float> C(128);
    for (std::size_t i = 0; i < 256; ++i) A[i] = bf(static_cast<float>(ga[i]));
    for (std::size_t i = 0; i < 128; ++i) B[i] = bf(static_cast<float>(gb[i]));
    for (std::size_t i = 0; i < 128; ++i) C[i] = static_cast<float>(gc[i]);
    auto const D = run_mma(A, B, C);
    auto const D2 = run_mma(A, B, C, true);
    for (unsigned r = 0; r < 16; ++r)
      for (unsigned n = 0; n < 8; ++n) {
        double acc = C[r * 8 + n], mag = std::abs(acc);
        for (unsigned k = 0; k < 16; ++k) {
          double const p = static_cast<double>(static_cast<float>(A[r * 16 + k])) * static_cast<float>(B[k * 8 + n]);
          acc += p;
          mag += std::abs(p);
        }
        CAPTURE(r);
        CAPTURE(n);
        if (on_host_runtime()) {
          CHECK(D[r * 8 + n] == static_cast<float>(acc));
        } else {
          CHECK(std::abs(D[r * 8 + n] - acc) <= 1e-6 * mag);
        }
        CHECK(D2[r * 8 + n] == D[r * 8 + n]);  // ldmatrix gives mma the same A fragments
      }
  }
}

TEST_CASE("mma_m16n8k16_bf16: fragment layouts pinned by exact integer products") {
  // A[r][c] = 16 r + c (integers up to 255: exact in bf16); B selects column n + 8 s of A.
  std::vector<bf> A(256);
  for (unsigned i = 0; i < 256; ++i) A[i] = bf(static_cast<float>(i));
  for (unsigned s = 0; s < 2; ++s) {
    std::vector<bf> B(128, bf(0.f));
    for (unsigned n = 0; n < 8; ++n) B[(n + 8 * s) * 8 + n] = bf(1.f);
    std::vector<float> C(128);
    for (unsigned i = 0; i < 128; ++i) C[i] = static_cast<float>(1000 * (i + 1));
    auto const D = run_mma(A, B, C);
    for (unsigned r = 0; r < 16; ++r)
      for (unsigned n = 0; n < 8; ++n) CHECK(D[r * 8 + n] == static_cast<float>(16 * r + n + 8 * s + 1000 * (r * 8 + n + 1)));
  }
}

TEST_CASE("ldmatrix_x4: each lane receives M_j[g][2t, 2t+1] (transposed: M_j[2t][g], M_j[2t+1][g])") {
  std::vector<std::uint16_t> src(256);
  for (unsigned i = 0; i < 256; ++i) src[i] = static_cast<std::uint16_t>(i * 3 + 7);
  dbuf<std::uint16_t> dsrc(src);
  for (bool trans : {false, true}) {
    CAPTURE(trans);
    dbuf<std::uint32_t> out(std::vector<std::uint32_t>(128, 0));
    if (trans)
      k3::cuda::launch_kernel(ldmatrix_kernel<true>, {dim3(1), dim3(32)}, dsrc.p, out.p);
    else
      k3::cuda::launch_kernel(ldmatrix_kernel<false>, {dim3(1), dim3(32)}, dsrc.p, out.p);
    K3_CUDA_CHECK(cudaGetLastError());
    K3_CUDA_CHECK(cudaDeviceSynchronize());
    auto const got = out.get();
    auto M = [&](unsigned j, unsigned i, unsigned k) { return std::uint32_t(src[j * 64 + i * 8 + k]); };
    for (unsigned l = 0; l < 32; ++l)
      for (unsigned j = 0; j < 4; ++j) {
        unsigned const g = l / 4, t = l % 4;
        std::uint32_t const want = trans ? (M(j, 2 * t, g) | (M(j, 2 * t + 1, g) << 16)) : (M(j, g, 2 * t) | (M(j, g, 2 * t + 1) << 16));
        CAPTURE(l);
        CAPTURE(j);
        CHECK(got[l * 4 + j] == want);
      }
  }
}
