#!/usr/bin/env python3
"""Plots for BENCHMARKS.md from the benchmarks' CSV rows (--csv FILE; columns in
benchmarks/common/bench.hpp; benchmarks/torch_kda.py writes the same columns).

Needs: Python 3 with matplotlib (any recent version; the Agg backend, no display).
Usage: plot.py CSV [CSV ...] [--out benchmarks/plots]
Writes (PNG, dpi 100):
  kda_throughput_vs_T.png  KDA forward tokens/s against T, one line per form and backend
                           (k3 cpu::serial / cpu::simd / cpu::threads, chunk and recurrent, and
                           the PyTorch naive chunked KDA, eager and torch.compile, when present)
  yardstick_ratios.png     every capability's figure over its same-run yardstick (bars)
"""
import argparse
import csv
import os
import sys

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit("plot.py needs matplotlib: pip install matplotlib")


def load(paths):
    rows = []
    for p in paths:
        if os.path.exists(p):
            with open(p, newline="") as f:
                rows += list(csv.DictReader(f))
    return rows


def kda_vs_T(rows, out):
    series = {}
    for r in rows:
        if r["benchmark"] != "kda" or r["op"] != "forward" or "T=" not in r["shape"]:
            continue
        key = (r["form"], r["backend"])
        series.setdefault(key, {})[int(r["T"])] = float(r["tokens_per_s"])
    # the sweep is the set with several T per (form, backend); the --quick table adds T = 4096
    # only for threads, which the sweep also has: keep the sweep's value when both exist
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    style = {"serial": ":", "simd": "--", "threads": "-", "torch_eager": "-.", "torch_compile": "-."}
    marks = {"chunk": "o", "recurrent": "s", "naive_chunk": "^"}
    for (form, be), pts in sorted(series.items()):
        Ts = sorted(pts)
        label = f"{'PyTorch ' + be[6:] if be.startswith('torch') else 'k3 ' + be} / {form}"
        ax.plot(Ts, [pts[t] for t in Ts], style.get(be, "-"), marker=marks.get(form, "x"), label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("T (tokens; B=1, H=16, K=V=128, float32)")
    ax.set_ylabel("forward tokens / s")
    ax.set_title("KDA forward throughput against T (2-vCPU Xeon, AVX-512)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "kda_throughput_vs_T.png"), dpi=100)
    plt.close(fig)


def ratios(rows, out):
    bars = []
    for r in rows:
        if r["benchmark"] in ("yardsticks",) or not r["yardstick"]:
            continue
        if r["benchmark"] == "kda" and r["op"] in ("forward", "backward"):
            # one T per (form, backend) in this plot: T = 4096 (the sweep's and the table's)
            if int(r["T"]) != 4096:
                continue
        label = f"{r['benchmark']} {r['op']} {r['form']} {r['backend']}"
        if r["benchmark"] == "kda" and "T=" in r["shape"]:
            label += f" T={r['T']}"
        bars.append((label, float(r["ratio"]), r["yardstick"], r["yardstick_unit"] == "s"))
    # keep the last row of each label (the --quick table's threads rows follow the sweep's)
    seen = {}
    for b in bars:
        seen[b[0]] = b
    bars = list(seen.values())
    fig, ax = plt.subplots(figsize=(8.5, 0.25 * len(bars) + 1.2))
    ys = range(len(bars))
    colors = ["tab:orange" if b[3] else "tab:blue" for b in bars]
    ax.barh(list(ys), [b[1] for b in bars], color=colors)
    ax.set_yticks(list(ys))
    ax.set_yticklabels([f"{b[0]}  [vs {b[2]}]" for b in bars], fontsize=6)
    ax.invert_yaxis()
    ax.axvline(1.0, color="k", lw=0.6)
    ax.set_xscale("log")
    ax.set_xlabel("ratio to the same-run yardstick (log; blue: rate ratio, orange: time ratio)")
    ax.xaxis.label.set_size(7)
    ax.set_title("Every capability against its same-run yardstick", fontsize=9)
    ax.grid(True, axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "yardstick_ratios.png"), dpi=100)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description="plots for BENCHMARKS.md")
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--out", default="benchmarks/plots")
    a = ap.parse_args()
    rows = load(a.csv)
    if not rows:
        sys.exit("no rows in " + " ".join(a.csv))
    os.makedirs(a.out, exist_ok=True)
    kda_vs_T(rows, a.out)
    ratios(rows, a.out)
    for n in ("kda_throughput_vs_T.png", "yardstick_ratios.png"):
        p = os.path.join(a.out, n)
        print(f"wrote {p} ({os.path.getsize(p) // 1024} KB)")


if __name__ == "__main__":
    main()
