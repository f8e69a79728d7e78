// k3/kda/preprocess.hpp — KDA's fused pre-processing on the CPU, each op with its backward:
//
//   l2norm / l2norm_backward                    q, k: x / sqrt(sum x^2 + 1e-6)
//   beta_sigmoid / beta_sigmoid_backward        beta = sigmoid(x) or 2 sigmoid(x)
//   gate_softplus / gate_softplus_backward      g = -exp(A_log) softplus(x + dt_bias)
//   gate_lower_bound / ..._backward             g = lb sigmoid(exp(A_log)(x + dt_bias)), lb in [-5, 0)
//   short_conv / short_conv_backward            causal depthwise conv (width 4) + SiLU, varlen
//   short_conv_decode                           one token per sequence, conv-state pool in place
//
// Every op is op(backend, args, options = {}): a host backend (k3::cpu::serial, k3::cpu::simd<>,
// k3::cpu::threads<>) or k3::cuda::stream_backend, one args aggregate of views
// (short_conv_args<In, P>, l2norm_args<In, Rank>, beta_sigmoid_args<In, Rank>, gate_args<In, P>
// and their *_backward_args, whose gradients are d_<name>; optional members left
// default-constructed are absent), then the options.
// Storage: float, double or k3::bfloat16 (fp32 math for bfloat16). Bad input throws k3::error
// naming the args member. Each args struct's last template parameter is the views' memory
// space (host_space by default): with cuda_device_space views the same calls run on
// k3::cuda::stream_backend (k3/kda/cuda/preprocess_backend.cuh), through the same checks.
#pragma once

#include "k3/kda/preprocess/common.hpp"
#include "k3/kda/preprocess/conv.hpp"
#include "k3/kda/preprocess/pointwise.hpp"
