// Misuse that must not compile: quantisation args of device views handed to a host backend.
// Needs no CUDA toolkit: the device-space views are plain types.
#include <k3/quant.hpp>

int main() {
  k3::quant::fp8_quantize_args<float, k3::cuda_device_space> a;
  k3::quant::fp8_quantize(k3::cpu::serial{}, a);
}
