// k3/core/config.hpp — compiler annotations shared by host and CUDA translation units.
//
// Two questions, two macros (as Eigen does): is a CUDA compiler processing this TU
// (K3_CUDA_COMPILER, both passes), and is this the device pass (K3_DEVICE_PASS).
// These macros may add attributes; they never change a host-visible definition (ODR).
#pragma once

#if defined(__CUDACC__)
#define K3_CUDA_COMPILER 1
#endif
#if defined(__CUDA_ARCH__)
#define K3_DEVICE_PASS 1
#endif

#if defined(K3_CUDA_COMPILER)
#define K3_HD __host__ __device__
#define K3_DEVICE __device__
#define K3_HOST __host__
#define K3_INLINE __forceinline__ __host__ __device__
#define K3_KERNEL __global__ __attribute__((visibility("hidden")))
#else
#define K3_HD
#define K3_DEVICE
#define K3_HOST
#define K3_INLINE inline
#if defined(K3_SIMT_RUNTIME)
// A kernel compiled by a host compiler for k3's SIMT runtime (k3/backend/simt/) is a plain
// function; inline, as kernels are defined in headers.
#define K3_KERNEL inline
#endif
#endif

// Unrolling hints for kernel loops: nvcc's pragma, nothing for host compilers.
#if defined(K3_CUDA_COMPILER)
#define K3_UNROLL _Pragma("unroll")
#else
#define K3_UNROLL
#endif

// Namespace-scope constants (CPO objects, tables) usable from kernels.
#if defined(K3_DEVICE_PASS)
#define K3_GLOBAL_CONSTANT __device__ constexpr
#else
#define K3_GLOBAL_CONSTANT inline constexpr
#endif

#if defined(__GNUC__) || defined(__clang__)
#define K3_RESTRICT __restrict__
#else
#define K3_RESTRICT
#endif
