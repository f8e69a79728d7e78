#!/usr/bin/env python3
"""Median new/base ratio per figure of two benchmark CSVs (see compare_builds.sh).

A figure is keyed by benchmark, op, form, backend, shape and T; its value is the same-run
yardstick ratio where the benchmark has one, else the throughput. Standard library only.
"""
import collections
import csv
import statistics
import sys


def load(path):
    figures = collections.defaultdict(list)
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            key = tuple(row[c] for c in ("benchmark", "op", "form", "backend", "shape", "T"))
            ratio = float(row["ratio"] or 0)
            value = ratio if ratio > 0 else float(row["throughput"] or 0)
            if value > 0:
                figures[key].append(value)
    return figures


def main(argv):
    if len(argv) != 3:
        sys.exit("usage: compare_builds.py BASE.csv NEW.csv")
    base, new = load(argv[1]), load(argv[2])
    ratios = []
    print("| benchmark | op | form | backend | base median | new median | new/base | base spread | new spread |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | --- | --- |")
    for key in sorted(base):
        if key not in new:
            continue
        b, n = base[key], new[key]
        r = statistics.median(n) / statistics.median(b)
        ratios.append(r)
        print(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {statistics.median(b):.4g} | "
              f"{statistics.median(n):.4g} | {r:.3f} | {min(b):.3g}-{max(b):.3g} | {min(n):.3g}-{max(n):.3g} |")
    if ratios:
        print(f"\n{len(ratios)} figures; median new/base {statistics.median(ratios):.3f}, "
              f"range {min(ratios):.3f}-{max(ratios):.3f}")


if __name__ == "__main__":
    main(sys.argv)
