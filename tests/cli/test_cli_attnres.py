"""k3 attnres end to end: the spec's numeric vector through .npy files, a numpy float64
reference on random data (forward and backward), and a clear error for a d mismatch."""
import os
import subprocess
import sys
import tempfile

import numpy as np

k3 = sys.argv[1]


def ref(V, w, g, eps, dh):
    # V [m, T, d]
    d = V.shape[2]
    u = g * w
    r = 1.0 / np.sqrt((V * V).mean(axis=2) + eps)  # [m, T]
    c = np.einsum("mtd,d->mt", V, u)
    s = r * c
    a = np.exp(s - s.max(axis=0))
    a /= a.sum(axis=0)
    h = np.einsum("mt,mtd->td", a, V)
    da = np.einsum("td,mtd->mt", dh, V)
    ds = a * (da - (a * da).sum(axis=0))
    dV = a[:, :, None] * dh[None] + ds[:, :, None] * (r[:, :, None] * u - (c * r**3)[:, :, None] * V / d)
    du = np.einsum("mt,mtd->d", ds * r, V)
    return h, dV, du * g, du * w


def run(dirin, dirout, *extra):
    return subprocess.run([k3, "attnres", "--in", dirin, "--out", dirout, *extra], capture_output=True, text=True)


fails = 0


def check(cond, what):
    global fails
    if not cond:
        print("FAIL:", what)
        fails += 1


with tempfile.TemporaryDirectory() as tmp:
    i, o = os.path.join(tmp, "in"), os.path.join(tmp, "out")
    os.makedirs(i)
    # spec vector: v2 given as the partial sum
    V = np.array([[1, -2, 3, 0.5], [0.5, 0.5, -1, 2], [-1, 1, 1, -1]], dtype=np.float64)[:, None, :]
    np.save(os.path.join(i, "sources.npy"), V[:2])
    np.save(os.path.join(i, "partial.npy"), V[2])
    np.save(os.path.join(i, "w.npy"), np.array([0.2, -0.1, 0.3, 0.05]))
    np.save(os.path.join(i, "gain.npy"), np.array([1, 1.5, 0.5, 1.0]))
    np.save(os.path.join(i, "dh.npy"), np.array([[1, 0, -1, 0.5]]))
    p = run(i, o, "--backward")
    check(p.returncode == 0, "spec vector run: " + p.stderr)
    h = np.load(os.path.join(o, "h.npy"))
    check(np.abs(h - [[0.403881, -0.606957, 1.406152, 0.587408]]).max() < 5e-7, "spec h")
    dv = np.concatenate([np.load(os.path.join(o, "dsources.npy")), np.load(os.path.join(o, "dpartial.npy"))[None]])
    want = np.array([[0.452702, 0.003544, -0.473257, 0.239818], [0.442841, -0.115229, -0.171609, 0.188624],
                     [0.170929, 0.035550, -0.313128, 0.118475]])
    check(np.abs(dv[:, 0, :] - want).max() < 5e-7, "spec dv")
    check(np.abs(np.load(os.path.join(o, "dw.npy")) - [0.526952, 0.783602, -0.997157, 1.831642]).max() < 5e-7, "spec dw")
    check(np.abs(np.load(os.path.join(o, "dgain.npy")) - [0.105390, -0.052240, -0.598294, 0.091582]).max() < 5e-7, "spec dgain")

    # random float32 problem without partial vs numpy float64
    rng = np.random.default_rng(0)
    n, T, d = 5, 7, 33
    V = (rng.standard_normal((n, T, d)) * np.exp(rng.uniform(-1, 1, (n, 1, 1)))).astype(np.float32)
    w = (rng.standard_normal(d) * 0.5).astype(np.float32)
    g = (1 + 0.2 * rng.standard_normal(d)).astype(np.float32)
    dh = rng.standard_normal((T, d)).astype(np.float32)
    os.remove(os.path.join(i, "partial.npy"))
    for name, arr in [("sources", V), ("w", w), ("gain", g), ("dh", dh)]:
        np.save(os.path.join(i, name + ".npy"), arr)
    p = run(i, o, "--backward", "--threads", "2")
    check(p.returncode == 0, "float32 run: " + p.stderr)
    hr, dVr, dwr, dgr = ref(V.astype(np.float64), w.astype(np.float64), g.astype(np.float64), 1e-5, dh.astype(np.float64))
    rel = lambda x, y: np.abs(x - y).max() / np.abs(y).max()
    check(np.load(os.path.join(o, "h.npy")).dtype == np.float32, "h dtype")
    check(rel(np.load(os.path.join(o, "h.npy")), hr) < 1e-6, "float32 h")
    check(rel(np.load(os.path.join(o, "dsources.npy")), dVr) < 1e-6, "float32 dsources")
    check(rel(np.load(os.path.join(o, "dw.npy")), dwr) < 1e-6, "float32 dw")
    check(rel(np.load(os.path.join(o, "dgain.npy")), dgr) < 1e-6, "float32 dgain")

    # d mismatch between sources and w: one clear line, non-zero exit
    np.save(os.path.join(i, "w.npy"), w[:-1])
    p = run(i, o)
    check(p.returncode != 0, "d mismatch must fail")
    err = p.stderr.strip()
    check(len(err.splitlines()) == 1 and "'w'" in err and "[33]" in err and "[32]" in err, "d mismatch message: " + err)

print("failures:", fails)
sys.exit(1 if fails else 0)
