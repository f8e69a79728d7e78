// Misuse that must not compile: routing args of device views handed to a host backend.
// Needs no CUDA toolkit: the device-space views are plain types.
#include <k3/moe.hpp>

int main() {
  k3::moe::route_args<float, k3::cuda_device_space> a;
  k3::moe::route(k3::cpu::serial{}, a);
}
