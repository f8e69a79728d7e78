// k3/kda/cuda_api.hpp — host-parsable declarations of the KDA CUDA launchers (no CUDA
// header needed: a .cpp compiled by g++ can call them). The definitions live in
// k3/kda/cuda/*.cuh; one .cu file of the program instantiates them with
//
//   #include <k3/kda/cuda/kda.cuh>
//   K3_KDA_CUDA_INSTANTIATE(float)
//   K3_KDA_CUDA_INSTANTIATE(k3::bfloat16)
//
// Conventions (fla's): token-major q, k [B, T, H, K]; v [B, T, HV, V] with HV a multiple of H
// (value head h reads q/k head h / (HV/H)); g [B, T, HV, K] natural-log per-channel decay,
// g <= 0; beta [B, T, HV]; states [N, HV, K, V] fp32. Per value head
//
//   S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T (scale q_t).
//
// All pointers are device pointers to contiguous tensors, except the *_host ones. Varlen:
// B == 1 and cu_seqlens [N+1] (device) plus the same values on the host (cu_seqlens_host,
// used for validation and sizing, like fla's cu_seqlens_cpu); N = B otherwise. Everything
// is enqueued on `stream` (nullptr: the legacy default stream); launchers return without
// synchronising. Bad arguments throw k3::error; CUDA failures throw k3::cuda::cuda_error.
//
// Limits (checked on the host): 1 <= K <= 128 (the kernels keep K-vectors and K x 32 state
// tiles in shared memory), V >= 1, chunk 64. The chunked forward needs about
// (3*64*K + 2*64*64 + 64*32 + 32*K + 64) * 4 bytes of shared memory (156 KiB at K = 128:
// sm_90 class GPUs).
#pragma once
#include <cstdint>

#include "k3/core/numeric/bfloat16.hpp"

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace k3::kda::cuda {

using index_t = std::int64_t;

inline constexpr index_t max_head_dim_k = 128;
inline constexpr index_t chunk_size = 64;

// Chunked forward (WY/UT form, chunk 64).
template <class S>
struct fwd_args {
  S const* q = nullptr;     // [B, T, H, K]
  S const* k = nullptr;     // [B, T, H, K]
  S const* v = nullptr;     // [B, T, HV, V]
  S const* g = nullptr;     // [B, T, HV, K]
  S const* beta = nullptr;  // [B, T, HV]
  float const* h0 = nullptr;  // [N, HV, K, V] or nullptr (zero initial state)
  S* o = nullptr;             // [B, T, HV, V]
  float* ht = nullptr;        // [N, HV, K, V] or nullptr (final state not wanted)
  std::int64_t const* cu_seqlens = nullptr;       // [N + 1] device, or nullptr
  std::int64_t const* cu_seqlens_host = nullptr;  // the same values on the host
  index_t N = 0;  // number of sequences when cu_seqlens is given (ignored otherwise)
  index_t B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0;
  float scale = 0.0f;  // <= 0 or not finite: K^-1/2
};

// Chunked backward from do (and optionally dht). Gradients are written in fp32; dq, dk, dg
// and dbeta are accumulated with atomics (summed over value heads of a group and V tiles),
// so their last bits may vary between runs. The per-chunk states are recomputed (not saved
// by the forward) and each chunk is replayed token by token in reverse; the launcher
// allocates its scratch with cudaMallocAsync on the stream:
// N * HV * ceil(V/32) * (ceil(max_len/64) + 64) * K * 32 * 4 bytes.
template <class S>
struct bwd_args {
  S const* q = nullptr;
  S const* k = nullptr;
  S const* v = nullptr;
  S const* g = nullptr;
  S const* beta = nullptr;
  float const* h0 = nullptr;   // [N, HV, K, V] or nullptr
  S const* do_ = nullptr;      // [B, T, HV, V]
  float const* dht = nullptr;  // [N, HV, K, V] or nullptr
  float* dq = nullptr;         // [B, T, H, K]
  float* dk = nullptr;         // [B, T, H, K]
  float* dv = nullptr;         // [B, T, HV, V]
  float* dg = nullptr;         // [B, T, HV, K]
  float* dbeta = nullptr;      // [B, T, HV]
  float* dh0 = nullptr;        // [N, HV, K, V] or nullptr
  std::int64_t const* cu_seqlens = nullptr;
  std::int64_t const* cu_seqlens_host = nullptr;
  index_t N = 0;
  index_t B = 0, T = 0, H = 0, HV = 0, K = 0, V = 0;
  float scale = 0.0f;
};

// Decode: one token per sequence; states live in a pool [P, HV, K, V] (fp32) updated in
// place, sequence n using slot slots[n] (or n when slots is nullptr, then P >= N). A
// negative slot marks a padding entry: it is skipped (its o is left untouched). Slots must
// be distinct; slots_host (optional, the same values on the host) enables the host-side
// range and uniqueness check; without it, out-of-range slots are skipped by the kernel.
template <class S>
struct decode_args {
  S const* q = nullptr;     // [N, H, K]
  S const* k = nullptr;     // [N, H, K]
  S const* v = nullptr;     // [N, HV, V]
  S const* g = nullptr;     // [N, HV, K]
  S const* beta = nullptr;  // [N, HV]
  float* state = nullptr;   // [P, HV, K, V]
  std::int64_t const* slots = nullptr;       // [N] device, or nullptr
  std::int64_t const* slots_host = nullptr;  // optional host copy for validation
  S* o = nullptr;                            // [N, HV, V]
  index_t N = 0, P = 0, H = 0, HV = 0, K = 0, V = 0;
  float scale = 0.0f;
};

// ---- pre-processing: the math of k3/kda/preprocess.hpp on the GPU -----------------------
// Contiguous tensors; rows = product of all dimensions but the last. Parameter gradients
// (dA_log, ddt_bias, dweight, dbias) are fp32 and accumulated with atomics (the launcher
// zeroes them first).

enum class gate_kind { softplus, lower_bound };

struct gate_params {
  gate_kind kind = gate_kind::softplus;
  float const* A_log = nullptr;    // [HV] or nullptr (A_log = 0)
  float const* dt_bias = nullptr;  // [HV, K] or nullptr (dt_bias = 0)
  float lower_bound = -5.0f;       // lower_bound gate only, in [-5, 0)
  index_t rows = 0;                // B * T
  index_t HV = 0, K = 0;
};

// Short causal depthwise conv (+ SiLU): x, y [B, T, C]; weight [C, W] fp32; bias [C] fp32
// or nullptr; conv states [N, C, W-1] fp32 (state[n, c, i] is position start - (W-1) + i).
struct conv_params {
  index_t B = 0, T = 0, C = 0, W = 4;
  float const* weight = nullptr;
  float const* bias = nullptr;
  std::int64_t const* cu_seqlens = nullptr;       // [N + 1] device, or nullptr (B sequences)
  std::int64_t const* cu_seqlens_host = nullptr;  // the same values on the host
  index_t N = 0;                                  // number of cu_seqlens sequences
  bool silu = true;
};

template <class S>
void l2norm_fwd(S const* x, S* y, index_t rows, index_t D, CUstream_st* stream);
template <class S>
void l2norm_bwd(S const* x, S const* dy, S* dx, index_t rows, index_t D, CUstream_st* stream);
template <class S>
void beta_sigmoid_fwd(S const* x, S* beta, index_t n, bool allow_neg_eigval, CUstream_st* stream);
template <class S>
void beta_sigmoid_bwd(S const* x, S const* dbeta, S* dx, index_t n, bool allow_neg_eigval, CUstream_st* stream);
template <class S>
void gate_fwd(gate_params const& p, S const* x, S* g, CUstream_st* stream);
// dA_log [HV] and ddt_bias [HV, K] may be nullptr (not wanted).
template <class S>
void gate_bwd(gate_params const& p, S const* x, S const* dg, S* dx, float* dA_log, float* ddt_bias, CUstream_st* stream);
// initial_state / final_state may be nullptr; final_state must not alias initial_state.
template <class S>
void short_conv_fwd(conv_params const& p, S const* x, S* y, float const* initial_state, float* final_state, CUstream_st* stream);
// dweight [C, W], dbias [C], d_initial_state [N, C, W-1] may be nullptr (not wanted).
template <class S>
void short_conv_bwd(conv_params const& p, S const* x, S const* dy, S* dx, float* dweight, float* dbias, float const* initial_state,
                    float* d_initial_state, CUstream_st* stream);
// One token per sequence: x, y [N, C]; conv_state pool [P, C, W-1] updated in place, slot
// slots[n] (nullptr: n; negative: padding, skipped). p.B, p.T and cu_seqlens are ignored.
template <class S>
void short_conv_decode(conv_params const& p, S const* x, S* y, index_t N, float* conv_state, index_t P, std::int64_t const* slots,
                       CUstream_st* stream);

// ---- KDA ------------------------------------------------------------------------------------

template <class S>
void chunk_fwd(fwd_args<S> const& a, CUstream_st* stream);
template <class S>
void chunk_bwd(bwd_args<S> const& a, CUstream_st* stream);
template <class S>
void decode(decode_args<S> const& a, CUstream_st* stream);

}  // namespace k3::kda::cuda
