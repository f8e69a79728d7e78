#!/bin/bash
# The benchmark sweep recorded in BENCHMARKS.md (run on an otherwise idle machine: the figures
# are same-run ratios, but a busy machine still distorts them). Usage, from the repository root
# after building with -DK3_BUILD_BENCHMARKS=ON:  benchmarks/sweep.sh [build-dir] > sweep.log
set -u
cd "${1:-build}/benchmarks" || exit 1
for r in 1 2; do date +%T; echo "== bench_kda"; ./bench_kda; done
for r in 1 2 3 4 5; do date +%T; ./bench_kda --decode-only | grep -E '^decode'; done
for r in 1 2; do date +%T; echo "== bench_kda --quick"; ./bench_kda --quick; done
for r in 1 2; do date +%T; echo "== bench_moe"; ./bench_moe; done
date +%T; echo "== bench_quant"; ./bench_quant
date +%T; echo "== bench_attnres"; ./bench_attnres
date +%T; echo "== bench_dplr"; ./bench_dplr
date +%T; echo "== bench_moe"; ./bench_moe
date +%T; echo "== bench_quant"; ./bench_quant
