// Misuse that must not compile: routing args of host views handed to the CUDA backend
// (compiled against the SIMT host runtime, so that no CUDA toolkit is needed).
#define K3_SIMT_RUNTIME 1
#include <k3/moe/cuda/route_backend.cuh>

int main() {
  k3::moe::route_args<float> a;
  k3::moe::route(k3::cuda::stream_backend{}, a);
}
