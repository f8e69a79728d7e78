// k3/kda/preprocess.hpp — KDA's fused pre-processing on the CPU, each op with its backward:
//
//   l2norm / l2norm_backward                    q, k: x / sqrt(sum x^2 + 1e-6)
//   beta_sigmoid / beta_sigmoid_backward        beta = sigmoid(x) or 2 sigmoid(x)
//   gate_softplus / gate_softplus_backward      g = -exp(A_log) softplus(x + dt_bias)
//   gate_lower_bound / ..._backward             g = lb sigmoid(exp(A_log)(x + dt_bias)), lb in [-5, 0)
//   short_conv / short_conv_backward            causal depthwise conv (width 4) + SiLU, varlen
//   short_conv_decode                           one token per sequence, conv-state pool in place
//
// All take a host backend first (k3::cpu::serial, k3::cpu::simd<>, k3::cpu::threads<>), then
// tensor_views; optional arguments accept nullptr. Storage: float, double or k3::bfloat16
// (fp32 math for bfloat16). Bad input throws k3::error naming the argument.
#pragma once

#include "k3/kda/preprocess/common.hpp"
#include "k3/kda/preprocess/conv.hpp"
#include "k3/kda/preprocess/pointwise.hpp"
