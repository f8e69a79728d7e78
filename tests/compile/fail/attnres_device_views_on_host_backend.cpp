// Misuse that must not compile: AttnRes args of device views handed to a host backend.
// Needs no CUDA toolkit: the device-space views are plain types.
#include <k3/attnres.hpp>

int main() {
  k3::attnres::phase1_args<float, float, k3::cuda_device_space> a;
  k3::attnres::phase1(k3::cpu::serial{}, a);
}
