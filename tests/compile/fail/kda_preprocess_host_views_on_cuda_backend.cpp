// Misuse that must not compile: KDA pre-processing args of host views handed to the CUDA
// backend (compiled against the SIMT host runtime, so that no CUDA toolkit is needed).
#define K3_SIMT_RUNTIME 1
#include <k3/kda/cuda/preprocess_backend.cuh>

int main() {
  k3::kda::l2norm_args<float> a;
  k3::kda::l2norm(k3::cuda::stream_backend{}, a);
}
