#!/usr/bin/env python3
"""k3's element encoders and decode tables against ml_dtypes, on many random floats.

ml_dtypes' astype() is the non-saturating cast (k3 saturation::none); for the saturating mode
the reference is ml_dtypes applied to np.clip(x, -max, max), which is what CUDA SATFINITE does
for finite inputs. Documented differences that are not compared byte for byte:
  * NaN inputs: k3 (like CUDA's float path) emits the canonical +NaN code; ml_dtypes keeps the
    NaN's sign (and uses 0x7E for E5M2). Both must decode to NaN.
  * FP6/FP4 NaN inputs: k3 gives +max (CUDA); ml_dtypes gives a signed zero.
  * E8M0 of FP32 subnormals in (2^-127, 2^-126): k3 rounds to the nearest power of two (as
    the brute-force test checks); ml_dtypes always rounds these up to 2^-126.
  * ±Inf in the saturating mode: k3 gives ±max (CUDA SATFINITE), not compared with ml_dtypes.
Usage: crosscheck_ml_dtypes.py ENCODE_TOOL WORKDIR.  Exit 77 (skipped) without ml_dtypes.
"""
import os
import warnings
import subprocess
import sys

try:
    import numpy as np
    import ml_dtypes
except ImportError:
    print("numpy/ml_dtypes not installed: skipping")
    sys.exit(77)

warnings.simplefilter("ignore", RuntimeWarning)
tool, work = sys.argv[1], sys.argv[2]
os.makedirs(work, exist_ok=True)
rng = np.random.default_rng(2026)

FORMATS = {
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e3m2": ml_dtypes.float6_e3m2fn,
    "e2m3": ml_dtypes.float6_e2m3fn,
    "e2m1": ml_dtypes.float4_e2m1fn,
    "e8m0": ml_dtypes.float8_e8m0fnu,
}

# Random bit patterns (every exponent, NaN, Inf, subnormals) plus values spread over each
# format's range (log-uniform magnitudes, random signs) and exact midpoints between values.
parts = [rng.integers(0, 2**32, size=1_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32)]
for t in FORMATS.values():
    fi = ml_dtypes.finfo(t)
    lo, hi = np.log2(float(fi.smallest_subnormal)) - 3, np.log2(float(fi.max)) + 2
    mags = np.exp2(rng.uniform(lo, hi, size=300_000)).astype(np.float32)
    signs = np.where(rng.random(300_000) < 0.5, -1, 1).astype(np.float32)
    parts.append(mags * signs)
    vals = np.unique(np.arange(256, dtype=np.uint8).view(t).astype(np.float64))
    vals = vals[np.isfinite(vals)]
    mids = ((vals[1:] + vals[:-1]) / 2).astype(np.float32)
    parts.append(np.concatenate([mids, -mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))]))
x = np.concatenate(parts).astype(np.float32)
np.save(os.path.join(work, "x.npy"), x)
subprocess.run([tool, work], check=True)

failures = 0
nbits = {"e4m3": 8, "e5m2": 8, "e3m2": 6, "e2m3": 6, "e2m1": 4, "e8m0": 8}
for name, t in FORMATS.items():
    codes = np.arange(2 ** nbits[name], dtype=np.uint8)
    ref = codes.view(t).astype(np.float32)
    ours = np.load(os.path.join(work, f"decode_{name}.npy"))
    same = (ours == ref) | (np.isnan(ours) & np.isnan(ref))
    same &= (np.signbit(ours) == np.signbit(ref)) | np.isnan(ref)
    if not same.all():
        print(f"{name}: decode differs at codes {codes[~same][:10]}")
        failures += 1

    nan_in = np.isnan(x)
    for mode in ("none", "finite"):
        got = np.load(os.path.join(work, f"codes_{name}_{mode}.npy"))
        if mode == "none":
            want = x.astype(t).view(np.uint8)
            cmp = ~nan_in
        else:
            fmax = np.float32(ml_dtypes.finfo(t).max)
            want = np.clip(x, -fmax, fmax).astype(t).view(np.uint8)
            cmp = np.isfinite(x)
            if name == "e8m0":  # saturating E8M0 clamps zero/negatives up to 2^-127 instead of NaN
                cmp &= x > 0
        if name == "e8m0":  # ml_dtypes rounds FP32 subnormals in (2^-127, 2^-126) up to 2^-126
            cmp &= ~((np.abs(x) > np.float32(2.0**-127)) & (np.abs(x) < np.float32(2.0**-126)))
        bad = cmp & (got != want)
        # NaN inputs: decode must be NaN for formats that have NaN
        if name in ("e4m3", "e5m2", "e8m0"):
            nan_ok = np.isnan(ref[got[nan_in]]).all()
            if not nan_ok:
                print(f"{name}/{mode}: a NaN input did not encode to a NaN code")
                failures += 1
        n = int(cmp.sum())
        if bad.any():
            idx = np.nonzero(bad)[0][:10]
            print(f"{name}/{mode}: {int(bad.sum())} of {n} differ, e.g. x={x[idx]} k3={got[idx]} ml_dtypes={want[idx]}")
            failures += 1
        else:
            print(f"{name}/{mode}: {n} encodes identical to ml_dtypes")

sys.exit(1 if failures else 0)
