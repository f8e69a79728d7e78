// Misuse that must not compile: KDA pre-processing args of device views handed to a host
// backend. Needs no CUDA toolkit: the device-space views are plain types.
#include <k3/kda/preprocess.hpp>

int main() {
  k3::kda::short_conv_args<float, float, k3::cuda_device_space> a;
  k3::kda::short_conv(k3::cpu::serial{}, a);
}
