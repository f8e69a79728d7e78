#!/usr/bin/env bash
# The one prepared GPU script: on a machine with an NVIDIA GPU, builds k3's CUDA tests and the
# GPU benchmark with nvcc for that GPU's architecture, runs every CUDA test on the device, and
# prints the benchmark table (tests/gpu/prepare.sh, run beforehand where Debian's packages
# are, supplies the header-only dependencies when the GPU machine lacks them).
#
#   bash tests/gpu/run.sh [--quick]
set -euo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')
prefix=()
if [ -d .gpu-deps/usr ]; then prefix=(-DCMAKE_PREFIX_PATH="$PWD/.gpu-deps/usr" -DCMAKE_INCLUDE_PATH="$PWD/.gpu-deps/usr/include"); fi
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DK3_ENABLE_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" \
  -DK3_BUILD_BENCHMARKS=ON -DK3_BUILD_EXAMPLES=OFF -DK3_ENABLE_MPI=OFF "${prefix[@]}" >build-gpu.log 2>&1 || { tail -30 build-gpu.log; exit 1; }
cmake --build build-gpu --target k3_gpu_tests bench_cuda -j "$(nproc)" >>build-gpu.log 2>&1 || { tail -60 build-gpu.log; exit 1; }
echo "built for sm_$arch in $(( $(date +%s) - start )) s"
ctest --test-dir build-gpu -L gpu --output-on-failure -E 'nccl' || status=$?
echo
./build-gpu/benchmarks/bench_cuda "$@"
echo "total $(( $(date +%s) - start )) s"
exit "${status:-0}"
