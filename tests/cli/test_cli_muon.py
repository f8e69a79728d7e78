"""End-to-end check of `k3 muon`: NS5 of matrices and stacks, per head and Moonlight-scaled,
against a float64 numpy implementation of the formula (spec moe_routing.md C.3); float32,
float64 and bfloat16 ('<u2') files; NS5(G^T) = NS5(G)^T bit for bit; NaN confined to its
matrix; usage errors; and, where mpirun exists, --distributed on 2, 3 and 4 ranks equal to the
single-process output bit for bit, with one JSON line per rank whose owners cover every matrix
once and whose received bytes stay within 1.5x of the average and 2/n of an all-gather's.
Usage: test_cli_muon.py K3_BINARY WORKDIR [MPIEXEC]"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np

k3, work = sys.argv[1], sys.argv[2]
mpiexec = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] else None
rng = np.random.default_rng(29)
fails = 0


def check(ok, what):
    global fails
    if not ok:
        fails += 1
        print("FAIL:", what)


def ns5(g, steps=5):
    x = np.asarray(g, dtype=np.float64)
    tr = x.shape[0] > x.shape[1]
    if tr:
        x = x.T
    x = x / (np.sqrt((x * x).sum()) + 1e-7)
    for _ in range(steps):
        a = x @ x.T
        b = -4.7750 * a + 2.0315 * (a @ a)
        x = 3.4445 * x + b @ x
    return x.T if tr else x


def reference(g, heads=1, scale="none", steps=5):
    g = np.asarray(g, dtype=np.float64)
    stack = g if g.ndim == 3 else g[None]
    out = np.empty_like(stack)
    A, B = stack.shape[1], stack.shape[2]
    r = A // heads
    for j in range(stack.shape[0]):
        for h in range(heads):
            out[j, h * r:(h + 1) * r] = ns5(stack[j, h * r:(h + 1) * r], steps)
    if scale == "moonlight":
        out *= 0.2 * np.sqrt(max(A, B))
    return out if g.ndim == 3 else out[0]


def run(g, *extra, name="case", launcher=None):
    d = os.path.join(work, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(os.path.join(d, "in"))
    np.save(os.path.join(d, "in", "g.npy"), g)
    cmd = (launcher or []) + [k3, "muon", "--in", os.path.join(d, "in"), "--out", os.path.join(d, "out"), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    o = os.path.join(d, "out", "o.npy")
    return r, (np.load(o) if r.returncode == 0 and os.path.exists(o) else None)


def bf16_bits(x):
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def rel(got, ref):
    return np.abs(got - ref).max() / np.abs(ref).max()


# float64: the formula to 1e-12, for matrices, stacks, heads and the Moonlight scale.
for shape, extra, heads, scale in [((9, 14), [], 1, "none"), ((14, 9), [], 1, "none"), ((1, 5), [], 1, "none"), ((12, 12), ["--steps", "3"], 1, "none"),
                                    ((3, 12, 20), ["--heads", "4"], 4, "none"), ((2, 30, 8), ["--heads", "3", "--scale", "moonlight"], 3, "moonlight"),
                                    ((2, 7, 260), ["--threads", "2"], 1, "none")]:
    g = rng.standard_normal(shape)
    r, o = run(g, *extra)
    check(r.returncode == 0, f"{shape} {extra}: exit {r.returncode}: {r.stderr}")
    if o is not None:
        steps = int(extra[extra.index("--steps") + 1]) if "--steps" in extra else 5
        check(o.dtype == np.float64 and o.shape == g.shape, f"{shape}: o is {o.dtype} {o.shape}")
        e = rel(o, reference(g, heads, scale, steps))
        check(e < 1e-12, f"float64 {shape} {extra}: max rel error {e:.3g}")

# float32 and bfloat16 files: same dtype back, close to the float64 formula.
g = rng.standard_normal((2, 24, 40))
r, o = run(g.astype(np.float32), "--heads", "2")
check(r.returncode == 0 and o is not None and o.dtype == np.float32, f"float32: {r.stderr}")
if o is not None:
    check(rel(o, reference(g.astype(np.float32), 2)) < 1e-4, f"float32: rel error {rel(o, reference(g.astype(np.float32), 2)):.3g}")
gb = bf16_bits(g)
r, o = run(gb, "--heads", "2", name="bf16")
check(r.returncode == 0 and o is not None and o.dtype == np.uint16, f"bfloat16: {r.stderr} {None if o is None else o.dtype}")
if o is not None:
    e = rel(from_bf16(o), reference(from_bf16(gb), 2))
    check(e < 2e-2, f"bfloat16: rel error {e:.3g}")

# NS5(G^T) = NS5(G)^T bit for bit (non-square).
g = rng.standard_normal((11, 37)).astype(np.float32)
_, o = run(g, name="t1")
_, ot = run(np.ascontiguousarray(g.T), name="t2")
check(o is not None and ot is not None and np.array_equal(o.T, ot), "NS5(G^T) != NS5(G)^T")

# NaN in one matrix: that matrix all NaN, the others as if alone.
g = rng.standard_normal((3, 6, 10))
g[1, 2, 3] = np.nan
r, o = run(g, name="nan")
check(r.returncode == 0 and o is not None, f"NaN input: {r.stderr}")
if o is not None:
    check(np.isnan(o[1]).all(), "the NaN matrix is not all NaN")
    check(np.isfinite(o[[0, 2]]).all() and rel(o[[0, 2]], reference(g[[0, 2]])) < 1e-12, "NaN leaked into other matrices")

# Usage errors and bad input: one clear line, the right exit status.
g = rng.standard_normal((8, 12))
for extra, code, text in [(["--steps", "0"], 2, "--steps"), (["--heads", "3"], 1, "3 heads do not divide the A = 8 rows"),
                          (["--scale", "spectral"], 2, "none|moonlight"), (["--heads", "0"], 2, "--heads")]:
    r, _ = run(g, *extra, name="err")
    check(r.returncode == code and text in r.stderr and len(r.stderr.strip().splitlines()) == 1,
          f"{extra}: exit {r.returncode}, stderr {r.stderr!r}")
for bad, text in [(rng.standard_normal(5), "expected a matrix [A, B] or a stack [M, A, B]"), (np.arange(6, dtype=np.int32).reshape(2, 3), "float32, float64 or bfloat16")]:
    r, _ = run(bad, name="err")
    check(r.returncode == 1 and text in r.stderr, f"bad input: exit {r.returncode}, stderr {r.stderr!r}")

# --distributed under mpirun: the local result bit for bit, and the plan's traffic.
if mpiexec:
    env_extra = {"OMPI_MCA_btl": "self,vader", "OMPI_MCA_btl_vader_single_copy_mechanism": "none", "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    os.environ.update(env_extra)
    # Open MPI itself leaks (~120 KB per rank, in plugins suppression files cannot name); the
    # same k3 code is leak-checked by the single-process runs above (as in k3_add_mpi_test).
    os.environ["ASAN_OPTIONS"] = (os.environ.get("ASAN_OPTIONS", "") + ":detect_leaks=0").lstrip(":")
    for dtype in (np.float32, np.float64):
        g = rng.standard_normal((7, 24, 40)).astype(dtype)
        _, local = run(g, "--heads", "2", "--scale", "moonlight", name="local")
        for n in (2, 3, 4):
            r, o = run(g, "--heads", "2", "--scale", "moonlight", "--distributed", name=f"dist{n}",
                       launcher=[mpiexec, "-n", str(n), "--oversubscribe", "--allow-run-as-root"])
            check(r.returncode == 0, f"distributed np {n}: exit {r.returncode}: {r.stderr}")
            check(o is not None and local is not None and o.dtype == g.dtype and np.array_equal(o, local), f"distributed np {n} differs from local")
            lines = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
            check(sorted(l["rank"] for l in lines) == list(range(n)), f"np {n}: JSON lines {r.stdout!r}")
            owned = sorted(j for l in lines for j in l["owned"])
            check(owned == list(range(7)), f"np {n}: owners {owned}")
            recv = [l["recv_bytes"] for l in lines]
            check(max(recv) <= 1.5 * sum(recv) / n, f"np {n}: received bytes {recv}")
            # An all-gather has every rank receive (n - 1)/n of the set; P2P moves 2/n of that in all.
            check(sum(recv) <= 2 * g.nbytes * (n - 1) / n + 7 * n * g.itemsize, f"np {n}: P2P moved {sum(recv)} bytes, more than 2/n of an all-gather")
else:
    print("mpirun not found: --distributed not checked")

print("k3 muon:", "FAILED" if fails else "passed", f"({fails} failures)")
sys.exit(1 if fails else 0)
