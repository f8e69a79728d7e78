#!/bin/bash
# Compares two builds of the benchmarks (before and after a change) on this machine: runs each
# benchmark of both builds alternately, ROUNDS times, so that load drifts hit both sides alike,
# appends to BASE.csv / NEW.csv in OUT, then prints each figure's median new/base ratio next to
# both sides' spread (benchmarks/compare_builds.py). Usage, from the repository root:
#   benchmarks/compare_builds.sh BASE_BUILD NEW_BUILD [OUT=compare-out] [ROUNDS=6] [python]
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
base=$(cd "$1/benchmarks" && pwd) || exit 1
new=$(cd "$2/benchmarks" && pwd) || exit 1
out=${3:-compare-out}
rounds=${4:-6}
py=${5:-python3}
mkdir -p "$out" && out=$(cd "$out" && pwd)
rm -f "$out/base.csv" "$out/new.csv"
for round in $(seq 1 "$rounds"); do
  for bench in "bench_quant" "bench_attnres" "bench_moe" "bench_preprocess" "bench_dplr" \
               "bench_kda --quick --no-backward"; do
    set -- $bench
    name=$1; shift
    for side in base new; do
      dir=$base; [ "$side" = new ] && dir=$new
      [ -x "$dir/$name" ] || { echo "skip $side $name: not built"; continue; }
      timeout 900 "$dir/$name" "$@" --csv "$out/$side.csv" > "$out/$side.$name.$round.log" 2>&1 \
        || echo "$side $name round $round: exit $?"
    done
  done
done
"$py" "$root/benchmarks/compare_builds.py" "$out/base.csv" "$out/new.csv"
