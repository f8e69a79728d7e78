#!/usr/bin/env bash
# Run here, before tests/gpu/run.sh travels to a GPU machine that has CUDA, CMake and ninja
# but no Debian packages and no network: copies the header-only dependencies (Eigen, xsimd,
# xtl, doctest) with their CMake package files into .gpu-deps/ (ignored by git).
set -euo pipefail
cd "$(dirname "$0")/../.."
rm -rf .gpu-deps
mkdir -p .gpu-deps
for p in libeigen3-dev libxsimd-dev xtl-dev doctest-dev; do
  dpkg -L "$p" | while read -r f; do
    if [ -f "$f" ]; then
      mkdir -p ".gpu-deps$(dirname "$f")"
      cp "$f" ".gpu-deps$f"
    fi
  done
done
du -sh .gpu-deps
