// Misuse that must not compile: a decode-shaped [N, C] view as the prefill's x ([B, T, C]).
#include <k3/backend/cpu/serial.hpp>
#include <k3/kda/preprocess.hpp>

int main() {
  float x[8] = {}, w[8] = {}, y[8] = {};
  k3::kda::short_conv(k3::cpu::serial{}, k3::kda::short_conv_args<float>{.x = k3::host_view(x, 2, 4), .weight = k3::host_view(w, 4, 2),
                                                                         .y = k3::host_view(y, 1, 2, 4)});
}
