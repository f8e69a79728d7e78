"""Shared helpers for the k3 CLI cross-checks (independent numpy references, not library code)."""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np


class Checker:
    def __init__(self, name):
        p = argparse.ArgumentParser(description=f"cross-check `k3 {name}` against an independent numpy reference")
        p.add_argument("--k3", default="build/examples/k3")
        p.add_argument("--seeds", type=int, default=3)
        p.add_argument("--keep", action="store_true", help="keep the temporary directories")
        p.add_argument("--verbose", "-v", action="store_true")
        p.add_argument("--only", default="", help="run only the cases whose label contains this")
        p.add_argument("--strict", action="store_true", help="also fail on the findings reported as WARN")
        self.args = p.parse_args()
        self.k3 = os.path.abspath(self.args.k3)
        self.name = name
        self.failures = []
        self.warnings = []
        self.passes = 0
        self.root = tempfile.mkdtemp(prefix=f"k3cc_{name}_")
        self.n = 0

    def want(self, label):
        return self.args.only in label

    def newdir(self):
        self.n += 1
        d = os.path.join(self.root, f"c{self.n}")
        os.makedirs(os.path.join(d, "in"))
        return d

    def run(self, d, opts, timeout=120, cmdname=None):
        cmd = [self.k3, cmdname or self.name, "--in", os.path.join(d, "in"), "--out", os.path.join(d, "out")] + list(opts)
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, "TIMEOUT", cmd
        return r.returncode, r.stderr + r.stdout, cmd

    def fail(self, label, msg, cmd=None):
        line = f"FAIL [{label}] {msg}"
        if cmd:
            line += "\n     cmd: " + " ".join(cmd)
        print(line, flush=True)
        self.failures.append(line)

    def warn(self, label, msg, cmd=None):
        if self.args.strict:
            return self.fail(label, msg, cmd)
        line = f"WARN [{label}] {msg}"
        if cmd:
            line += "\n     cmd: " + " ".join(cmd)
        print(line, flush=True)
        self.warnings.append(line)

    def ok(self, label):
        self.passes += 1
        if self.args.verbose:
            print(f"ok   [{label}]", flush=True)

    def out(self, d, name):
        return np.load(os.path.join(d, "out", name + ".npy"))

    def expect_error(self, label, d, opts=(), must_mention=None):
        """The run must exit non-zero with one clear line on stderr, no crash/hang."""
        rc, text, cmd = self.run(d, opts, timeout=60, cmdname="dequant" if label.startswith("dq ") else None)
        lines = [l for l in text.strip().splitlines() if l.strip()]
        if rc is None:
            self.fail(label, "hang (timeout)", cmd)
        elif rc == 0:
            self.fail(label, "expected an error, got exit 0", cmd)
        elif rc < 0 or rc > 2:
            self.fail(label, f"crash: exit {rc}: {text.strip()[:300]}", cmd)
        elif len(lines) != 1:
            self.fail(label, f"expected one error line, got {len(lines)}: {text.strip()[:300]}", cmd)
        elif must_mention and not any(m in lines[0].split(": ", 1)[-1] for m in ([must_mention] if isinstance(must_mention, str) else must_mention)):
            self.fail(label, f"error does not mention {must_mention!r}: {lines[0]}", cmd)
        else:
            if self.args.verbose:
                print(f"ok   [{label}] error: {lines[0]}")
            self.passes += 1

    def finish(self):
        print(f"{self.name}: {self.passes} checks passed, {len(self.failures)} failed, {len(self.warnings)} warnings")
        if not self.args.keep and not self.failures:
            shutil.rmtree(self.root, ignore_errors=True)
        else:
            print("temporary directories kept under", self.root)
        sys.exit(1 if self.failures else 0)


def same_outputs(ck, label, d_ref, d_alt, outs, opts=()):
    """Runs k3 on two input directories that hold the same numbers in different .npy layouts
    (C / Fortran order, little- / big-endian): every output must be bitwise the same."""
    got = []
    for d in (d_ref, d_alt):
        rc, text, cmd = ck.run(d, list(opts))
        if rc != 0:
            ck.fail(label, f"exit {rc}: {text.strip()[:300]}", cmd)
            return
        got.append([ck.out(d, o) for o in outs])
    for o, a, b in zip(outs, *got):
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            ck.fail(label, f"{o} differs from the C-order little-endian run", cmd)
            return
    ck.ok(label)


def save(d, name, a):
    np.save(os.path.join(d, "in", name + ".npy"), a)


def rel_rms(got, ref):
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if got.shape != ref.shape:
        return np.inf
    if got.size == 0:
        return 0.0
    num = np.sqrt(np.mean((got - ref) ** 2))
    den = np.sqrt(np.mean(ref ** 2))
    if den == 0:
        return num
    return num / den


def compare(ck, label, got, ref, tol, cmd=None, name=""):
    got = np.asarray(got)
    if got.shape != np.asarray(ref).shape:
        ck.fail(label, f"{name}: shape {got.shape} != expected {np.asarray(ref).shape}", cmd)
        return False
    if not np.all(np.isfinite(got.astype(np.float64)) == np.isfinite(np.asarray(ref, dtype=np.float64))):
        ck.fail(label, f"{name}: non-finite pattern differs (got {np.sum(~np.isfinite(got.astype(np.float64)))} non-finite,"
                f" expected {np.sum(~np.isfinite(np.asarray(ref, dtype=np.float64)))})", cmd)
        return False
    fin = np.isfinite(np.asarray(ref, dtype=np.float64))
    e = rel_rms(got[fin], np.asarray(ref)[fin])
    if not (e <= tol):
        ck.fail(label, f"{name}: rel-RMS {e:.3e} > {tol:.1e}", cmd)
        return False
    ck.ok(f"{label} {name} {e:.1e}")
    return True


def grads_complex_step(ref, inp, names, do, dht, elementwise, rng, ndir=3):
    """Derivatives of L = <do, o> + <dht, ht>, (o, ht) = ref(args) with args a dict of the inputs
    (leading direction axis added), by the complex step (exact to rounding). For each name in
    `names` with a non-empty input: (dirs [D, ...], dL along each direction [D]); elementwise uses
    the unit directions, i.e. the full gradient."""
    h = 1e-30
    res = {}
    for nm in names:
        x = inp[nm]
        if x is None or x.size == 0:
            continue
        dirs = np.eye(x.size).reshape((x.size,) + x.shape) if elementwise else rng.standard_normal((ndir,) + x.shape)
        D = dirs.shape[0]
        args = {n: (None if a is None else np.broadcast_to(a, (D,) + a.shape).astype(np.complex128)) for n, a in inp.items()}
        args[nm] = args[nm] + 1j * h * dirs
        o, ht = ref(args)
        L = o.reshape(D, -1) @ do.ravel() + (ht.reshape(D, -1) @ dht.ravel() if dht is not None else 0)
        res[nm] = (dirs, L.imag / h)
    return res


def compare_grads(ck, label, res, shapes, grad_names, tol, elementwise, cmd):
    """Checks k3's gradients against grads_complex_step's `res`: shapes[nm] = (k3's array, the
    input's shape). Elementwise, or as directional derivatives (relative RMS over the directions)."""
    for nm, (dirs, dd) in res.items():
        got, ref_shape = shapes[nm]
        if got.shape != ref_shape:
            ck.fail(label, f"{grad_names[nm]}: shape {got.shape} != {ref_shape}", cmd)
            continue
        if elementwise:
            compare(ck, label, got, dd.reshape(ref_shape), tol, cmd, grad_names[nm])
            continue
        proj = dirs.reshape(dirs.shape[0], -1) @ got.astype(np.float64).ravel()
        err = np.sqrt(np.mean((proj - dd) ** 2)) / (np.sqrt(np.mean(dd ** 2)) + 1e-300)
        if not err <= tol:
            ck.fail(label, f"{grad_names[nm]}: directional derivative rel err {err:.3e} > {tol:.1e} (got {proj}, ref {dd})", cmd)
        else:
            ck.ok(f"{label} {grad_names[nm]} dir {err:.1e}")


def run_recurrence_case(ck, label, rng, inp, names, grad_names, ref, opts, scale=None, cu=None, cu_dtype=np.int64,
                        backward=True, elementwise=False, tol_f=None, tol_b=None, dht_on=True):
    """One `k3 kda` / `k3 dplr` run against a float64 reference ref(inputs, scale) -> (o, ht):
    q [B,T,H,K], v [B,T,HV,V], states [N,HV,K,V]; with `backward`, the gradients of
    <do, o> + <dht, ht> by the complex step. `opts` are the subcommand's options (without
    --scale / --backward)."""
    dtype = inp["q"].dtype
    d = ck.newdir()
    for nm in names:
        if inp[nm] is not None:
            save(d, nm, inp[nm])
    if cu is not None:
        save(d, "cu_seqlens", np.asarray(cu, dtype=cu_dtype))
    B, T, H, K = inp["q"].shape
    HV, V = inp["v"].shape[2:]
    nseq = B if cu is None else len(cu) - 1
    do = rng.standard_normal((B, T, HV, V)).astype(dtype)
    dht = rng.standard_normal((nseq, HV, K, V)).astype(dtype) if dht_on else None
    if backward:
        save(d, "do", do)
        if dht is not None:
            save(d, "dht", dht)
    opts = list(opts) + (["--scale", repr(scale)] if scale is not None else []) + (["--backward"] if backward else [])
    rc, text, cmd = ck.run(d, opts)
    if rc != 0:
        ck.fail(label, f"exit {rc}: {text.strip()[:400]}", cmd)
        return
    sc = K ** -0.5 if scale is None else scale
    f64 = {n: (None if inp[n] is None else inp[n].astype(np.float64)) for n in names}
    o_ref, ht_ref = ref(f64, sc)
    tol_f = tol_f or (1e-12 if dtype == np.float64 else 2e-5)
    tol_b = tol_b or (1e-11 if dtype == np.float64 else 1e-4)
    for nm, r in (("o", o_ref), ("ht", ht_ref)):
        got = ck.out(d, nm)
        if got.dtype != dtype:
            ck.fail(label, f"{nm}: dtype {got.dtype}, expected {dtype}", cmd)
        compare(ck, label, got, r, tol_f, cmd, nm)
    if not backward:
        return
    if f64["h0"] is None:  # dh0 is still written (w.r.t. a zero initial state)
        f64["h0"] = np.zeros((nseq, HV, K, V))
    res = grads_complex_step(lambda x: ref(x, sc), f64, names, do.astype(np.float64),
                             None if dht is None else dht.astype(np.float64), elementwise, rng)
    compare_grads(ck, label, res, {nm: (ck.out(d, grad_names[nm]), f64[nm].shape) for nm in res}, grad_names, tol_b,
                  elementwise, cmd)


def zero_size_cases(ck, make, names, V=3):
    """T = 0 (B = 1) and B = 0 through `k3 kda` / `k3 dplr` --backward: empty outputs with h0
    passed through to ht, or one clear error line. make(B, T) -> inputs with one value head of width V."""
    for (B, T) in ((1, 0), (0, 4)):
        lab = f"zero-size B{B} T{T}"
        x = make(B, T)
        d = ck.newdir()
        for nm in names:
            save(d, nm, x[nm])
        save(d, "do", np.zeros((B, T, 1, V)))
        rc, text, cmd = ck.run(d, ["--backward"])
        if rc == 0:
            compare(ck, lab, ck.out(d, "ht"), x["h0"], 0, cmd, "ht")
            compare(ck, lab, ck.out(d, "o"), np.zeros((B, T, 1, V)), 0, cmd, "o")
        elif rc not in (1, 2) or len(text.strip().splitlines()) != 1:
            ck.fail(lab, f"exit {rc}: {text[:300]}", cmd)
        else:
            ck.ok(lab)


def write_raw_npy(path, header_dict_str, payload, version=(1, 0)):
    """Write an .npy with an arbitrary header (for malformed-input tests)."""
    magic = b"\x93NUMPY" + bytes(version)
    h = header_dict_str.encode("latin1")
    hl = 4 if version[0] >= 2 else 2
    pad = (64 - (len(magic) + hl + len(h) + 1) % 64) % 64
    h = h + b" " * pad + b"\n"
    with open(path, "wb") as f:
        f.write(magic + len(h).to_bytes(hl, "little") + h + payload)
