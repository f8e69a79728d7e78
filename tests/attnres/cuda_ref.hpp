// CPU results (k3::cpu::serial, float storage) for the CUDA test; compiled by the host compiler
// (the .cu test must not include xsimd or Eigen).
#pragma once
#include <cstdint>

namespace attnres_cuda_ref {
using i64 = std::int64_t;
void mix_forward(float const* bank, i64 n, float const* partial, i64 T, i64 d, float const* w, float const* gain, float eps, float* h);
void mix_backward(float const* bank, i64 n, float const* partial, i64 T, i64 d, float const* w, float const* gain, float eps, float const* dh,
                  float* dbank, float* dpartial, float* dw, float* dg);
void phase1(float const* bank, i64 n, i64 T, i64 d, float const* u, i64 nq, float eps, float* rinv, float* o, float* lse);
void phase2_add(float const* o, float const* lse, float* prefix, float const* delta, float const* u, i64 T, i64 d, float eps, float* h);
}  // namespace attnres_cuda_ref
