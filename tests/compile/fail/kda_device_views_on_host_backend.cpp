// Misuse that must not compile: KDA args of device views handed to a host backend.
#include <k3/kda.hpp>

int main() {
  k3::kda::forward_args<float, float, k3::cuda_device_space> a;
  k3::kda::forward(k3::cpu::threads<>{}, a);
}
