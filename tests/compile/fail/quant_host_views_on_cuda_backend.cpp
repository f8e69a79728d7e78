// Misuse that must not compile: quantisation args of host views handed to the CUDA backend
// (compiled against the SIMT host runtime, so that no CUDA toolkit is needed).
#define K3_SIMT_RUNTIME 1
#include <k3/quant/cuda/backend.cuh>

int main() {
  k3::quant::fp8_quantize_args<float> a;
  k3::quant::fp8_quantize(k3::cuda::stream_backend{}, a);
}
