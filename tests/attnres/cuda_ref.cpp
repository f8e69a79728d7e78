#include "attnres/cuda_ref.hpp"

#include "k3/attnres.hpp"

namespace ar = k3::attnres;
using k3::tensor_view;

namespace attnres_cuda_ref {

static ar::sources<float> src(float const* bank, i64 n, float const* partial, i64 T, i64 d) {
  tensor_view<float const, 3> b(bank, {n, T, d});
  return partial ? ar::make_sources(b, tensor_view<float const, 2>(partial, {T, d})) : ar::make_sources(b);
}

void mix_forward(float const* bank, i64 n, float const* partial, i64 T, i64 d, float const* w, float const* gain, float eps, float* h) {
  ar::options o;
  o.eps = eps;
  ar::mix_forward(k3::cpu::serial{},
                  ar::mix_forward_args<float>{.sources = src(bank, n, partial, T, d),
                                              .w = tensor_view<float const, 1>(w, {d}),
                                              .gain = tensor_view<float const, 1>(gain, {d}),
                                              .h = k3::host_view(h, T, d)},
                  o);
}

void mix_backward(float const* bank, i64 n, float const* partial, i64 T, i64 d, float const* w, float const* gain, float eps, float const* dh,
                  float* dbank, float* dpartial, float* dw, float* dg) {
  ar::options o;
  o.eps = eps;
  ar::mix_backward(k3::cpu::serial{},
                   ar::mix_backward_args<float>{.sources = src(bank, n, partial, T, d),
                                                .w = tensor_view<float const, 1>(w, {d}),
                                                .gain = tensor_view<float const, 1>(gain, {d}),
                                                .d_h = tensor_view<float const, 2>(dh, {T, d}),
                                                .d_sources = ar::make_grads(k3::host_view(dbank, n, T, d), k3::host_view(dpartial, T, d)),
                                                .d_w = k3::host_view(dw, d),
                                                .d_gain = k3::host_view(dg, d)},
                   o);
}

void phase1(float const* bank, i64 n, i64 T, i64 d, float const* u, i64 nq, float eps, float* rinv, float* o, float* lse) {
  k3::cpu::serial b;
  for (i64 j = 0; j < n; ++j)
    ar::block_rinv(b,
                   ar::block_rinv_args<float>{.block = tensor_view<float const, 2>(bank + j * T * d, {T, d}), .rinv = k3::host_view(rinv + j * T, T)},
                   {.eps = eps});
  ar::phase1(b, ar::phase1_args<float>{.bank = tensor_view<float const, 3>(bank, {n, T, d}),
                                       .bank_rinv = tensor_view<float const, 2>(rinv, {n, T}),
                                       .u = tensor_view<float const, 2>(u, {nq, d}),
                                       .o = k3::host_view(o, nq, T, d),
                                       .lse = k3::host_view(lse, nq, T)});
}

void phase2_add(float const* o, float const* lse, float* prefix, float const* delta, float const* u, i64 T, i64 d, float eps, float* h) {
  ar::phase2_add(k3::cpu::serial{},
                 ar::phase2_add_args<float>{.o = tensor_view<float const, 2>(o, {T, d}),
                                            .lse = tensor_view<float const, 1>(lse, {T}),
                                            .prefix = k3::host_view(prefix, T, d),
                                            .delta = tensor_view<float const, 2>(delta, {T, d}),
                                            .u = tensor_view<float const, 1>(u, {d}),
                                            .h = k3::host_view(h, T, d)},
                 {.eps = eps});
}

}  // namespace attnres_cuda_ref
