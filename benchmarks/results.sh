#!/bin/bash
# Regenerates the figures and plots of BENCHMARKS.md: every benchmark with --csv into
# benchmarks/results/k3.csv (one CSV row per figure; columns in common/bench.hpp), the PyTorch
# comparison into benchmarks/results/torch_kda.csv, stdout into benchmarks/results/*.log, then
# the plots (benchmarks/plots/*.png). Usage, from the repository root after building with
# -DK3_BUILD_BENCHMARKS=ON:   benchmarks/results.sh [build-dir] [python]
# python: an interpreter with numpy and matplotlib (and torch for the PyTorch comparison;
# without torch that step prints a skip message); default python3. Run on an otherwise idle
# machine: the figures are same-run ratios, but a busy machine still distorts them.
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-build}" && pwd) || exit 1
py=${2:-python3}
out=$root/benchmarks/results
mkdir -p "$out"
rm -f "$out/k3.csv" "$out/torch_kda.csv" "$out"/*.log
cd "$build/benchmarks" || exit 1
run() { local log=$1; shift; echo "== $* --csv benchmarks/results/k3.csv" >> "$out/$log.log"; "$@" --csv "$out/k3.csv" >> "$out/$log.log" 2>&1; }
run yardsticks ./bench_yardsticks
run kda ./bench_kda --quick
run kda_sweep ./bench_kda --sweep-T 256,512,1024,2048,4096,8192 --reps 3
run preprocess ./bench_preprocess
run moe ./bench_moe
run quant ./bench_quant
run attnres ./bench_attnres
run dplr ./bench_dplr
run muon ./bench_muon 3
run latent_moe ./bench_latent_moe 128 3
if [ -x ./bench_dplr_mpi ] && command -v mpirun > /dev/null; then
  for np in 1 2; do run dplr_mpi mpirun --allow-run-as-root --oversubscribe -np $np ./bench_dplr_mpi; done
fi
cd "$root"
"$py" benchmarks/torch_kda.py --T 256,512,1024,2048,4096 --csv benchmarks/results/torch_kda.csv > "$out/torch_kda.log" 2>&1
"$py" benchmarks/plot.py benchmarks/results/k3.csv benchmarks/results/torch_kda.csv --out benchmarks/plots
