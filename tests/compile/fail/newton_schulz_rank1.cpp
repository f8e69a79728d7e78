// Misuse that must not compile: NS5 of a rank-1 view (a vector is not a matrix).
#include <k3/backend/cpu/serial.hpp>
#include <k3/optim/newton_schulz.hpp>

int main() {
  float g[4] = {}, o[4] = {};
  k3::optim::newton_schulz(k3::cpu::serial{}, k3::optim::newton_schulz_args<float, 1>{{g, {4}}, {o, {4}}});
}
