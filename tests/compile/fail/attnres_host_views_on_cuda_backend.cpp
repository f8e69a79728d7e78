// Misuse that must not compile: AttnRes args of host views handed to the CUDA backend
// (compiled against the SIMT host runtime, so that no CUDA toolkit is needed).
#define K3_SIMT_RUNTIME 1
#include <k3/attnres/cuda/backend.cuh>

int main() {
  k3::attnres::mix_forward_args<float> a;
  k3::attnres::mix_forward(k3::cuda::stream_backend{}, a);
}
