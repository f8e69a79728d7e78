// Misuse that must not compile: NS5 of an integer matrix.
#include <k3/backend/cpu/serial.hpp>
#include <k3/optim/newton_schulz.hpp>

int main() {
  int g[4] = {}, o[4] = {};
  k3::optim::newton_schulz(k3::cpu::serial{}, k3::optim::newton_schulz_args<int, 2>{{g, {2, 2}}, {o, {2, 2}}});
}
