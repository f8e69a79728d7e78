"""End-to-end check of `k3 moe`: the Stable LatentMoE layer against a numpy float64 forward
written from the formula in `k3 moe --help` (1e-12 in float64, 2e-5 in float32, bfloat16
loosely), every gradient of --backward against central differences of <y, dy> along random
directions, the outputs' names, dtypes and shapes, and errors (k > n, NaN in x, a partial set of
shared experts). Usage: test_cli_moe.py K3_BINARY WORKDIR"""
import os
import shutil
import subprocess
import sys

import numpy as np

k3, work = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(27)
fails = 0


def check(ok, what):
    global fails
    if not ok:
        fails += 1
        print("FAIL:", what)


T, d, n, l, f, s, F, k = 7, 6, 9, 5, 4, 2, 3, 3
opt = dict(k=k, scale=2.5, eps=1e-6, bg=4.0, bu=25.0)


def sig(v):
    return 1 / (1 + np.exp(-v))


def situ(g, u):
    return opt["bg"] * np.tanh(g / opt["bg"]) * sig(g) * opt["bu"] * np.tanh(u / opt["bu"])


def forward(P):
    sc = sig(P["x"] @ P["w_router"].T)
    key = sc + P["bias"]
    idx = np.stack([sorted(range(n), key=lambda e: (-key[t, e], e))[:k] for t in range(T)])
    ss = np.take_along_axis(sc, idx, 1)
    tot = ss.sum(1, keepdims=True)
    p = ss / np.where(tot > 0, tot, 1) * opt["scale"]
    z = P["x"] @ P["w_down"].T
    u = np.zeros((T, l))
    for t in range(T):
        for r in range(k):
            e = idx[t, r]
            a = situ(P["we_gate"][e] @ z[t], P["we_up"][e] @ z[t])
            u[t] += p[t, r] * (P["we_down"][e] @ a)
    rr = u / np.sqrt((u * u).mean(1, keepdims=True) + opt["eps"]) * P["norm_weight"]
    y = rr @ P["w_up"].T
    for j in range(s):
        y += situ(P["x"] @ P["ws_gate"][j].T, P["x"] @ P["ws_up"][j].T) @ P["ws_down"][j].T
    return y, idx, p


P = dict(x=rng.standard_normal((T, d)), w_router=0.5 * rng.standard_normal((n, d)), bias=0.1 * rng.standard_normal(n),
         w_down=0.4 * rng.standard_normal((l, d)), we_gate=0.5 * rng.standard_normal((n, f, l)), we_up=0.5 * rng.standard_normal((n, f, l)),
         we_down=0.4 * rng.standard_normal((n, l, f)), norm_weight=1 + 0.3 * rng.standard_normal(l), w_up=0.4 * rng.standard_normal((d, l)),
         ws_gate=0.4 * rng.standard_normal((s, F, d)), ws_up=0.4 * rng.standard_normal((s, F, d)), ws_down=0.4 * rng.standard_normal((s, d, F)))
dy = rng.standard_normal((T, d))
flags = ["--k", str(k), "--scale", "2.5"]


def run(inputs, *extra, name="case"):
    dd = os.path.join(work, name)
    shutil.rmtree(dd, ignore_errors=True)
    os.makedirs(os.path.join(dd, "in"))
    for key, v in inputs.items():
        np.save(os.path.join(dd, "in", key + ".npy"), v)
    r = subprocess.run([k3, "moe", "--in", os.path.join(dd, "in"), "--out", os.path.join(dd, "out"), *extra], capture_output=True, text=True)
    out = {}
    if r.returncode == 0:
        for fn in os.listdir(os.path.join(dd, "out")):
            out[fn[:-4]] = np.load(os.path.join(dd, "out", fn))
    return r, out


y_ref, idx_ref, p_ref = forward(P)
r, o = run(P, *flags)
check(r.returncode == 0, f"forward: {r.stderr}")
if r.returncode == 0:
    check(set(o) == {"y", "indices", "weights"}, f"forward outputs {sorted(o)}")
    check(o["indices"].dtype == np.int64 and np.array_equal(o["indices"], idx_ref), "indices")
    e = np.abs(o["y"] - y_ref).max() / np.abs(y_ref).max()
    check(e < 1e-12, f"float64 y: rel error {e:.3g}")
    check(np.abs(o["weights"] - p_ref).max() < 1e-12, "float64 weights")

# float32 and bfloat16 files.
r, o = run({key: v.astype(np.float32) for key, v in P.items()}, *flags, name="f32")
if r.returncode == 0:
    y32, _, _ = forward({key: v.astype(np.float32).astype(np.float64) for key, v in P.items()})
    check(o["y"].dtype == np.float32 and np.abs(o["y"] - y32).max() / np.abs(y32).max() < 2e-5, "float32 y")
else:
    check(False, f"float32: {r.stderr}")


def bf16(v):
    u = np.asarray(v, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def unbf16(b):
    return (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


r, o = run({key: bf16(v) for key, v in P.items()}, *flags, name="bf16")
if r.returncode == 0:
    yb, _, _ = forward({key: unbf16(bf16(v)) for key, v in P.items()})
    check(o["y"].dtype == np.uint16 and np.abs(unbf16(o["y"]) - yb).max() / np.abs(yb).max() < 2e-2, "bfloat16 y")
else:
    check(False, f"bfloat16: {r.stderr}")

# --backward: every gradient against a central difference of <y, dy> along a random direction.
r, g = run(dict(P, dy=dy), *flags, "--backward", name="bwd")
check(r.returncode == 0, f"backward: {r.stderr}")
if r.returncode == 0:
    want = {"y", "indices", "weights", "dx", "dw_router", "dw_down", "dwe_gate", "dwe_up", "dwe_down", "dnorm_weight", "dw_up", "dws_gate",
            "dws_up", "dws_down"}
    check(set(g) == want, f"backward outputs {sorted(set(g) ^ want)}")
    h = 1e-6
    for key in ["x", "w_router", "w_down", "we_gate", "we_up", "we_down", "norm_weight", "w_up", "ws_gate", "ws_up", "ws_down"]:
        v = rng.standard_normal(P[key].shape)
        Pp, Pm = dict(P), dict(P)
        Pp[key] = P[key] + h * v
        Pm[key] = P[key] - h * v
        num = ((forward(Pp)[0] * dy).sum() - (forward(Pm)[0] * dy).sum()) / (2 * h)
        got = (g["d" + key] * v).sum()
        check(abs(got - num) <= 1e-6 * max(1.0, abs(num)), f"d{key}: {got} vs central difference {num}")
    check(np.array_equal(g["y"], y_ref) or np.abs(g["y"] - y_ref).max() < 1e-12, "backward's y")

# Errors.
r, _ = run(P, "--k", "10", name="err")
check(r.returncode == 1 and "expected 1 <= k <= n = 9" in r.stderr, f"k > n: {r.returncode} {r.stderr!r}")
bad = dict(P)
bad["x"] = P["x"].copy()
bad["x"][3, 2] = np.nan
r, _ = run(bad, *flags, name="err")
check(r.returncode == 1 and "non-finite value at [3, 2] (token 3)" in r.stderr, f"NaN x: {r.returncode} {r.stderr!r}")
part = {key: v for key, v in P.items() if key != "ws_down"}
r, _ = run(part, *flags, name="err")
check(r.returncode == 1 and "all three or none" in r.stderr, f"partial shared experts: {r.stderr!r}")
r, _ = run(P, "--eps", "0", name="err")
check(r.returncode == 2 and "--eps" in r.stderr, f"eps 0: {r.returncode} {r.stderr!r}")
r, _ = run({key: v for key, v in P.items() if key != "w_up"}, *flags, name="err")
check(r.returncode == 1 and "missing input 'w_up.npy'" in r.stderr, f"missing w_up: {r.stderr!r}")

print("k3 moe:", "FAILED" if fails else "passed", f"({fails} failures)")
sys.exit(1 if fails else 0)
