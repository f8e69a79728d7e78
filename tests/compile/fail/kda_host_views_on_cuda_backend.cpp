// Misuse that must not compile: KDA args of host views handed to the CUDA backend (compiled
// against the SIMT host runtime, so that no CUDA toolkit is needed).
#define K3_SIMT_RUNTIME 1
#include <k3/kda/cuda/backend.cuh>

int main() {
  k3::kda::forward_args<float> a;
  k3::kda::forward(k3::cuda::stream_backend{}, a);
}
