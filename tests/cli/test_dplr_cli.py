"""End-to-end check of `k3 dplr`: writes random inputs, runs the tool, compares o/ht with a
float64 numpy recurrence and the backward with finite differences of it; checks that a bad
shape gives one clear error line and a non-zero exit. Usage: test_dplr_cli.py K3_BINARY WORKDIR"""
import os
import subprocess
import sys

import numpy as np

k3, work = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(5)
B, T, H, K, V = 1, 23, 2, 5, 4
cu = np.array([0, 9, 9, 23], dtype=np.int32)
N = len(cu) - 1


def rnd(*s, sc=1.0):
    return rng.standard_normal(s) * sc


x = dict(q=rnd(B, T, H, K), k=rnd(B, T, H, K, sc=0.4), v=rnd(B, T, H, V), a=rnd(B, T, H, K, sc=0.3), b=rnd(B, T, H, K, sc=0.3),
         gk=-np.log1p(np.exp(-rnd(B, T, H, K))) / 4, h0=rnd(N, H, K, V, sc=0.5))
do, dht = rnd(B, T, H, V), rnd(N, H, K, V)
scale = K ** -0.5


def forward(x):
    o = np.zeros((B, T, H, V))
    ht = np.zeros((N, H, K, V))
    for n in range(N):
        for h in range(H):
            S = x["h0"][n, h].copy()
            for t in range(cu[n], cu[n + 1]):
                P = np.diag(np.exp(x["gk"][0, t, h])) + np.outer(x["b"][0, t, h], x["a"][0, t, h])
                S = P @ S + np.outer(x["k"][0, t, h], x["v"][0, t, h])
                o[0, t, h] = S.T @ (scale * x["q"][0, t, h])
            ht[n, h] = S
    return o, ht


def loss(x):
    o, ht = forward(x)
    return (o * do).sum() + (ht * dht).sum()


def run(indir, outdir, *extra):
    return subprocess.run([k3, "dplr", "--in", indir, "--out", outdir, *extra], capture_output=True, text=True)


indir, outdir = os.path.join(work, "in"), os.path.join(work, "out")
os.makedirs(indir, exist_ok=True)
for name, arr in x.items():
    np.save(os.path.join(indir, name + ".npy"), arr)
np.save(os.path.join(indir, "cu_seqlens.npy"), cu)
np.save(os.path.join(indir, "do.npy"), do)
np.save(os.path.join(indir, "dht.npy"), dht)
fails = 0
for extra in ([], ["--threads", "2", "--chunk-size", "4"], ["--mode", "recurrent"]):
    r = run(indir, outdir, "--backward", *extra)
    if r.returncode != 0:
        print("k3 dplr failed:", r.stderr)
        sys.exit(1)
    o_ref, ht_ref = forward(x)
    o, ht = np.load(os.path.join(outdir, "o.npy")), np.load(os.path.join(outdir, "ht.npy"))
    e = max(abs(o - o_ref).max(), abs(ht - ht_ref).max())
    if e > 1e-12:
        print(extra, "forward error", e)
        fails += 1
    eps = 1e-6
    for name, gname in [("q", "dq"), ("k", "dk"), ("v", "dv"), ("a", "da"), ("b", "db"), ("gk", "dgk"), ("h0", "dh0")]:
        g = np.load(os.path.join(outdir, gname + ".npy"))
        d = rng.standard_normal(x[name].shape)
        xp = dict(x); xp[name] = x[name] + eps * d
        xm = dict(x); xm[name] = x[name] - eps * d
        fd = (loss(xp) - loss(xm)) / (2 * eps)
        if abs(fd - (g * d).sum()) > 1e-6 * max(1, abs(fd)):
            print(extra, gname, "fd", fd, "analytic", (g * d).sum())
            fails += 1
# float32 path runs and is close
os.makedirs(indir + "32", exist_ok=True)
for name, arr in x.items():
    np.save(os.path.join(indir + "32", name + ".npy"), arr.astype(np.float32))
np.save(os.path.join(indir + "32", "cu_seqlens.npy"), cu.astype(np.int64))
r = run(indir + "32", outdir + "32")
o32 = np.load(os.path.join(outdir + "32", "o.npy"))
if r.returncode != 0 or o32.dtype != np.float32 or abs(o32 - forward(x)[0]).max() > 1e-4:
    print("float32 run failed", r.stderr)
    fails += 1
# a bad shape: one clear line naming the argument, non-zero exit
np.save(os.path.join(indir + "32", "a.npy"), x["a"][:, :, :, :3].astype(np.float32))
r = run(indir + "32", outdir + "32")
if r.returncode == 0 or "'a'" not in r.stderr or len(r.stderr.strip().splitlines()) != 1:
    print("bad shape not reported clearly:", r.returncode, r.stderr)
    fails += 1
# mixed dtypes
np.save(os.path.join(indir + "32", "a.npy"), x["a"])
r = run(indir + "32", outdir + "32")
if r.returncode == 0 or "'a'" not in r.stderr:
    print("dtype mismatch not reported:", r.stderr)
    fails += 1
print("passed" if fails == 0 else "FAILED", fails)
sys.exit(1 if fails else 0)
