#!/usr/bin/env python3
"""`k3 quant` / `k3 dequant` end to end: output shapes and dtypes, dequant.npy equal to the codes
decoded with ml_dtypes times the scales, `k3 dequant` reproducing dequant.npy, and bad input
giving one line on stderr and a non-zero exit. Usage: quant_cli_roundtrip.py K3 WORKDIR (exit 77
without numpy/ml_dtypes)."""
import os
import subprocess
import sys

try:
    import numpy as np
    import ml_dtypes
except ImportError:
    print("numpy/ml_dtypes not installed: skipping")
    sys.exit(77)

k3, work = sys.argv[1], sys.argv[2]
os.makedirs(work, exist_ok=True)
rng = np.random.default_rng(5)
x = (rng.standard_normal((3, 4, 256)) * np.exp2(rng.uniform(-6, 6, (3, 4, 1)))).astype(np.float32)
np.save(os.path.join(work, "x.npy"), x)
fail = 0


def run(*args, ok=True):
    r = subprocess.run([k3, *args], capture_output=True, text=True)
    if (r.returncode == 0) != ok:
        print("unexpected exit", r.returncode, args, r.stderr)
        return False
    if not ok and len(r.stderr.strip().splitlines()) != 1:
        print("expected one stderr line, got:", r.stderr)
        return False
    return True


def decode(codes, dtype, bits):
    if bits == 4:
        lo, hi = codes & 0xF, codes >> 4
        codes = np.stack([lo, hi], axis=-1).reshape(*codes.shape[:-1], codes.shape[-1] * 2)
    return codes.view(dtype).astype(np.float32)


cases = [
    ("e4m3", "1x128", "fp32"), ("e4m3", "128x128", "ue8m0"), ("e4m3", "128x1", "fp32"),
    ("mxfp8", "32", "floor"), ("mxfp8_e5m2", "32", "rceil"), ("mxfp6", "32", "rceil"), ("mxfp6_e2m3", "32", "floor"),
    ("mxfp4", "32", "rceil"), ("nvfp4", "16", "ue4m3"),
]
elem = {"e4m3": (ml_dtypes.float8_e4m3fn, 8), "mxfp8": (ml_dtypes.float8_e4m3fn, 8), "mxfp8_e5m2": (ml_dtypes.float8_e5m2, 8),
        "mxfp6": (ml_dtypes.float6_e3m2fn, 6), "mxfp6_e2m3": (ml_dtypes.float6_e2m3fn, 6), "mxfp4": (ml_dtypes.float4_e2m1fn, 4),
        "nvfp4": (ml_dtypes.float4_e2m1fn, 4)}
for fmt, block, scale in cases:
    out = os.path.join(work, f"{fmt}_{block}")
    if not run("quant", "--format", fmt, "--block", block, "--scale", scale, "--in", work, "--out", out):
        fail += 1
        continue
    codes = np.load(os.path.join(out, "codes.npy"))
    scales = np.load(os.path.join(out, "scales.npy"))
    deq = np.load(os.path.join(out, "dequant.npy"))
    dt, bits = elem[fmt]
    vals = decode(codes, dt, bits)
    if deq.shape != x.shape or codes.dtype != np.uint8:
        print(fmt, "bad shapes", codes.shape, deq.shape)
        fail += 1
        continue
    rows = vals.reshape(-1, 256)
    if fmt == "e4m3":
        tr, tc = map(int, block.split("x"))
        s = np.repeat(np.repeat(scales, tr, axis=0)[: rows.shape[0]], tc, axis=1)[:, :256]
        want = rows * s
    elif fmt == "nvfp4":
        g = np.load(os.path.join(out, "tensor_scale.npy"))[0]
        sb = scales.reshape(-1, 16).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        want = rows * (np.repeat(sb, 16, axis=1) * g)
    else:
        sb = scales.reshape(-1, 8).view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
        want = rows * np.repeat(sb, 32, axis=1)
    if not np.array_equal(want.astype(np.float32), deq.reshape(-1, 256)):
        print(fmt, block, "dequant.npy differs from decoded codes x scales")
        fail += 1
    rel = np.abs(deq - x).max() / np.abs(x).max()
    bound = {8: 0.15, 6: 0.3, 4: 0.6}[bits]  # FLOOR may clip the top binade
    if rel > bound:
        print(fmt, "error too large", rel)
        fail += 1
    back = os.path.join(work, f"{fmt}_{block}_back")
    if not run("dequant", "--format", fmt, "--block", block, "--in", out, "--out", back):
        fail += 1
        continue
    if not np.array_equal(np.load(os.path.join(back, "x.npy")), deq):
        print(fmt, "k3 dequant differs from dequant.npy")
        fail += 1
    print(f"{fmt} {block} {scale}: ok (max rel error {rel:.3g})")

# bad input
bad = os.path.join(work, "bad")
os.makedirs(bad, exist_ok=True)
np.save(os.path.join(bad, "x.npy"), np.zeros((2, 40), np.float32))
fail += not run("quant", "--format", "mxfp8", "--in", bad, "--out", bad + "_o", ok=False)   # 40 % 32 != 0
fail += not run("quant", "--format", "mxfp4", "--block", "1x128", "--in", work, "--out", bad + "_o", ok=False)
fail += not run("quant", "--format", "e4m3", "--scale", "rceil", "--in", work, "--out", bad + "_o", ok=False)
fail += not run("quant", "--in", work, "--out", bad + "_o", ok=False)
np.save(os.path.join(bad, "x.npy"), np.zeros((2, 64), np.int32))
fail += not run("quant", "--format", "e4m3", "--in", bad, "--out", bad + "_o", ok=False)
sys.exit(1 if fail else 0)
