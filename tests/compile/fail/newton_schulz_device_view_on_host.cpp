// Misuse that must not compile: device views handed to a host backend.
#include <k3/backend/cpu/serial.hpp>
#include <k3/optim/newton_schulz.hpp>

int main() {
  float* g = nullptr;
  float* o = nullptr;
  k3::optim::newton_schulz(k3::cpu::serial{}, k3::optim::newton_schulz_args<float, 2, k3::cuda_device_space>{{g, {2, 2}}, {o, {2, 2}}});
}
