"""Cross-check of `k3 kda` and `k3 dplr`: option combinations and inputs the other checkers do
not combine, against float64 references written here from shared/spec/kda.md (1.1 and 4.1),
not from the library code.

- every KDA option at once (--scale, --backward, cu_seqlens int32/int64 with empty sequences at
  the start, in a row and at the end, h0, dht) in both modes, and the two modes against each other;
- value-head ratios 3 and 5, K/V = 1, odd K/V above 128 and below 16, beta < 0 and beta > 1,
  g = -inf (an exact reset), no decay over a long sequence, an exploding state (documented below);
- the promised gate bound: g exactly at -5 accepted, one ulp below rejected naming --gate-lower-bound;
- NaN in one value head confined to its head (forward and gradients);
- every input in Fortran order (incl. h0, dht, do, cu_seqlens) giving the same bytes;
- mixed dtypes, wrong-rank (0-d / 1-d) inputs, odd cu_seqlens dtypes, missing files, --scale
  0 / negative / non-finite: one clear error line naming what the user typed;
- `k3 dplr` with --chunk-size / --long-sequence / --threads / --mode / --scale / cu_seqlens / h0 /
  dht / --backward together, and its bad inputs.
Gradients: complex-step derivatives of <do, o> + <dht, ht> along random directions.
"""
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Checker, compare, save  # noqa: E402

import ml_dtypes  # noqa: E402

ck = Checker("kda")  # the subcommand of ck.run unless a case names another
f32, f64 = np.float32, np.float64
bf16 = ml_dtypes.bfloat16
rng = np.random.default_rng(20261130 + ck.args.seeds)


# ---------------------------------------------------------------------------------------------
# References (leading axes allowed in front of every tensor, for the complex step).

def sequences(B, T, cu):
    return [(b, 0, T) for b in range(B)] if cu is None else [(0, int(cu[i]), int(cu[i + 1])) for i in range(len(cu) - 1)]


def kda_ref(x, scale, cu):
    """spec 1.1: S' = Diag(exp g_t) S; S = S' + beta_t k_t (v_t - S'^T k_t)^T; o_t = S^T (scale q_t)."""
    q, k, v, g, beta, h0 = (x[n] for n in ("q", "k", "v", "g", "beta", "h0"))
    *L, B, T, H, K = q.shape
    HV, V = v.shape[-2:]
    G = HV // H
    qe, ke = np.repeat(q, G, axis=-2), np.repeat(k, G, axis=-2)  # value head hv reads head hv // G
    seqs = sequences(B, T, cu)
    dt = np.result_type(*[a for a in x.values() if a is not None])
    o = np.zeros(tuple(L) + (B, T, HV, V), dt)
    ht = np.zeros(tuple(L) + (len(seqs), HV, K, V), dt)
    with np.errstate(all="ignore"):
        for n, (b, s, e) in enumerate(seqs):
            S = np.zeros(tuple(L) + (HV, K, V), dt) if h0 is None else h0[..., n, :, :, :].astype(dt)
            for t in range(s, e):
                S = np.exp(g[..., b, t, :, :])[..., :, None] * S
                kt = ke[..., b, t, :, :]
                u = v[..., b, t, :, :] - np.einsum("...hk,...hkv->...hv", kt, S)
                S = S + beta[..., b, t, :, None, None] * kt[..., :, None] * u[..., None, :]
                o[..., b, t, :, :] = np.einsum("...hk,...hkv->...hv", scale * qe[..., b, t, :, :], S)
            ht[..., n, :, :, :] = S
    return o, ht


def dplr_ref(x, scale, cu):
    """spec 4.1: S_t = Diag(exp gk_t) S + b_t (a_t^T S) + k_t v_t^T; o_t = S_t^T (scale q_t)."""
    q, k, v, a, b_, gk, h0 = (x[n] for n in ("q", "k", "v", "a", "b", "gk", "h0"))
    *L, B, T, H, K = q.shape
    V = v.shape[-1]
    seqs = sequences(B, T, cu)
    dt = np.result_type(*[y for y in x.values() if y is not None])
    o = np.zeros(tuple(L) + (B, T, H, V), dt)
    ht = np.zeros(tuple(L) + (len(seqs), H, K, V), dt)
    with np.errstate(all="ignore"):
        for n, (bb, s, e) in enumerate(seqs):
            S = np.zeros(tuple(L) + (H, K, V), dt) if h0 is None else h0[..., n, :, :, :].astype(dt)
            for t in range(s, e):
                aS = np.einsum("...hk,...hkv->...hv", a[..., bb, t, :, :], S)
                S = (np.exp(gk[..., bb, t, :, :])[..., :, None] * S + b_[..., bb, t, :, :, None] * aS[..., None, :]
                     + k[..., bb, t, :, :, None] * v[..., bb, t, :, None, :])
                o[..., bb, t, :, :] = np.einsum("...hk,...hkv->...hv", scale * q[..., bb, t, :, :], S)
            ht[..., n, :, :, :] = S
    return o, ht


# ---------------------------------------------------------------------------------------------
# Helpers

def check(label, name, got, ref, tol):
    return compare(ck, label, got, ref, tol, name=name)


def run(label, d, opts=(), cmd=None):
    rc, text, c = ck.run(d, list(opts), cmdname=cmd)
    if rc != 0:
        ck.fail(label, f"exit {rc}: {text.strip()[:400]}", c)
        return None
    return {f[:-4]: np.load(os.path.join(d, "out", f)) for f in os.listdir(os.path.join(d, "out"))}


def error_case(label, d, opts=(), mention=None, cmd=None, not_mention=None, line_ok=None):
    """Exit 1 or 2 with exactly one stderr line that names `mention` (and not `not_mention`);
    line_ok(line) -> problem text or None, for what else the line must say."""
    rc, text, c = ck.run(d, list(opts), timeout=60, cmdname=cmd)
    lines = [l for l in text.strip().splitlines() if l.strip()]
    if rc is None:
        ck.fail(label, "hang", c)
    elif rc == 0:
        ck.fail(label, "expected an error, got exit 0", c)
    elif rc not in (1, 2):
        ck.fail(label, f"crash: exit {rc}: {text.strip()[:300]}", c)
    elif len(lines) != 1:
        ck.fail(label, f"expected one error line, got {len(lines)}: {text.strip()[:300]}", c)
    elif mention and mention not in lines[0]:
        ck.fail(label, f"error does not name {mention!r}: {lines[0]}", c)
    elif not_mention and not_mention in lines[0]:
        ck.fail(label, f"error names {not_mention!r} (not what the user typed): {lines[0]}", c)
    elif line_ok and line_ok(lines[0]):
        ck.fail(label, f"{line_ok(lines[0])}: {lines[0]}", c)
    else:
        ck.ok(label)
        if ck.args.verbose:
            print("     ", lines[0])


def directional(ref, x, names, do, dht, ndir=2):
    """{name: (dirs, d<do,o>+<dht,ht> along each)} by the complex step."""
    h = 1e-30
    res = {}
    for nm in names:
        if x.get(nm) is None or x[nm].size == 0:
            continue
        dirs = rng.standard_normal((ndir,) + x[nm].shape)
        args = {n: (None if a is None else np.broadcast_to(a, (ndir,) + a.shape).astype(np.complex128)) for n, a in x.items()}
        args[nm] = args[nm] + 1j * h * dirs
        o, ht = ref(args)
        Ld = o.reshape(ndir, -1) @ do.ravel() + (0 if dht is None else ht.reshape(ndir, -1) @ dht.ravel())
        res[nm] = (dirs, Ld.imag / h)
    return res


def check_grads(label, res, got, gname, tol):
    for nm, (dirs, dd) in res.items():
        g = got.get(gname[nm])
        if g is None or g.shape != dirs.shape[1:]:
            ck.fail(label, f"{gname[nm]}: missing or shape {None if g is None else g.shape} != {dirs.shape[1:]}")
            continue
        proj = dirs.reshape(dirs.shape[0], -1) @ g.astype(f64).ravel()
        err = np.sqrt(np.mean((proj - dd) ** 2)) / (np.sqrt(np.mean(dd ** 2)) + 1e-300)
        if not err <= tol:
            ck.fail(label, f"{gname[nm]}: directional derivative rel err {err:.3e} > {tol:.1e}")
        else:
            ck.ok(f"{label} {gname[nm]}")


KDA_IN = ("q", "k", "v", "g", "beta", "h0")
KDA_GRAD = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "h0": "dh0"}
DPLR_IN = ("q", "k", "v", "a", "b", "gk", "h0")
DPLR_GRAD = {"q": "dq", "k": "dk", "v": "dv", "a": "da", "b": "db", "gk": "dgk", "h0": "dh0"}


def l2n(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def kda_inputs(B, T, H, HV, K, V, N=None, dtype=f64, gate=(-0.3, 0.0), beta=(0.0, 1.0), h0=True):
    x = {"q": rng.standard_normal((B, T, H, K)), "k": l2n(rng.standard_normal((B, T, H, K))),
         "v": rng.standard_normal((B, T, HV, V)), "g": rng.uniform(*gate, (B, T, HV, K)),
         "beta": rng.uniform(*beta, (B, T, HV)),
         "h0": rng.standard_normal((B if N is None else N, HV, K, V)) if h0 else None}
    return {n: (None if a is None else a.astype(dtype)) for n, a in x.items()}


def write(d, x, cu=None, cu_dtype=np.int64, extra=None):
    for n, a in x.items():
        if a is not None:
            save(d, n, a)
    if cu is not None:
        save(d, "cu_seqlens", np.asarray(cu, dtype=cu_dtype))
    for n, a in (extra or {}).items():
        save(d, n, a)


def kda_case(label, x, cu=None, cu_dtype=np.int64, scale=None, modes=("chunk", "recurrent"), backward=True, dht=True,
             tol_f=1e-12, tol_b=1e-10, extra_opts=(), ndir=2):
    """Both modes against the reference and against each other; returns {mode: outputs}."""
    B, T, H, K = x["q"].shape
    HV, V = x["v"].shape[2:]
    N = B if cu is None else len(cu) - 1
    dtype = x["q"].dtype
    do = rng.standard_normal((B, T, HV, V)).astype(dtype)
    dh = rng.standard_normal((N, HV, K, V)).astype(dtype if dtype != bf16 else f32) if dht else None
    sc = K ** -0.5 if scale is None else scale
    x64 = {n: (None if a is None else a.astype(f64)) for n, a in x.items()}
    o_ref, ht_ref = kda_ref(x64, sc, cu)
    outs = {}
    for mode in modes:
        if not ck.want(label):
            return outs
        d = ck.newdir()
        write(d, x, cu, cu_dtype, ({"do": do} | ({"dht": dh} if dht else {})) if backward else None)
        opts = ["--mode", mode] + (["--scale", repr(scale)] if scale is not None else []) + (["--backward"] if backward else [])
        r = run(f"{label} {mode}", d, opts + list(extra_opts))
        if r is None:
            continue
        outs[mode] = r
        check(f"{label} {mode}", "o", r["o"], o_ref, tol_f)
        check(f"{label} {mode}", "ht", r["ht"], ht_ref, tol_f)
        if backward:
            xg = dict(x64)
            if xg["h0"] is None:
                xg["h0"] = np.zeros((N, HV, K, V))
            res = directional(lambda y: kda_ref(y, sc, cu), xg, KDA_IN, do.astype(f64), None if dh is None else dh.astype(f64), ndir)
            check_grads(f"{label} {mode}", res, r, KDA_GRAD, tol_b)
    if len(outs) == 2 and dtype == f64:
        for nm in outs["chunk"]:
            check(f"{label} chunk vs recurrent", nm, outs["chunk"][nm], outs["recurrent"][nm], 1e-12)
    return outs


# ---------------------------------------------------------------------------------------------
# KDA: every option at once, packed sequences with empty ones at the start, in a row and at the end.

for cu_dtype in (np.int32, np.int64):
    cu = [0, 0, 5, 5, 5, 37, 101, 101]
    x = kda_inputs(1, 101, 2, 4, 9, 5, N=len(cu) - 1)
    lab = f"kda all options cu {np.dtype(cu_dtype).name}"
    outs = kda_case(lab, x, cu, cu_dtype, scale=0.37)
    for mode, r in outs.items():
        # An empty sequence passes h0 to ht and dht to dh0 unchanged (identity map).
        for n in (0, 2, 3, 6):
            if not (np.array_equal(r["ht"][n], x["h0"][n]) and r["dh0"].shape[0] == 7):
                ck.fail(f"{lab} {mode}", f"empty sequence {n}: ht != h0")
            else:
                ck.ok(f"{lab} {mode} empty {n}")

# Only empty sequences (T = 0): ht = h0, dh0 = dht, empty gradients.
for mode in ("chunk", "recurrent"):
    lab = f"kda only empty sequences {mode}"
    if not ck.want(lab):
        break
    x = kda_inputs(1, 0, 1, 2, 3, 2, N=3)
    d = ck.newdir()
    dh = rng.standard_normal((3, 2, 3, 2))
    write(d, x, [0, 0, 0, 0], np.int32, {"do": np.zeros((1, 0, 2, 2)), "dht": dh})
    r = run(lab, d, ["--mode", mode, "--backward", "--scale", "2"])
    if r is not None:
        ok = np.array_equal(r["ht"], x["h0"]) and np.array_equal(r["dh0"], dh) and r["o"].shape == (1, 0, 2, 2) and r["dq"].shape == (1, 0, 1, 3)
        (ck.ok if ok else lambda l: ck.fail(l, "ht != h0 or dh0 != dht or wrong empty shapes"))(lab)

# Head ratios, odd and tiny widths.
kda_case("kda HV=3H K=131 V=129", kda_inputs(1, 70, 1, 3, 131, 129), modes=("chunk",), ndir=1)
kda_case("kda HV=5H K=3 V=1", kda_inputs(2, 19, 2, 10, 3, 1))
kda_case("kda K=1 V=1", kda_inputs(1, 67, 1, 1, 1, 1, gate=(-2, 0)))
kda_case("kda K=1 V=7 HV=2H B=3", kda_inputs(3, 17, 2, 4, 1, 7, gate=(-8, 0), h0=False), dht=False)

# beta outside [0, 1]: negative and above 1 (k normalised: eigenvalue 1 - beta in (-1.5, 1.7)).
kda_case("kda beta in [-0.7, 0]", kda_inputs(1, 80, 1, 2, 17, 6, beta=(-0.7, 0)))
kda_case("kda beta in [1, 2.5]", kda_inputs(1, 40, 1, 1, 8, 4, beta=(1, 2.5), gate=(-0.05, 0)), tol_f=1e-11, tol_b=1e-9)

# g = -inf on some tokens: exp(-inf) = 0 resets the state exactly.
x = kda_inputs(1, 90, 1, 2, 6, 5, gate=(-1, 0))
x["g"][0, [3, 40, 64, 65], 0, :] = -np.inf
x["g"][0, 70, 1, 2] = -np.inf
kda_case("kda g = -inf resets", x, backward=False)

def value_below_bound(gval):
    """The error must print g's value exactly (once "%g" printed it as -5: "value -5 ... below ... = -5")."""
    def problem(line):
        m = re.search(r"value (\S+) at .* = (\S+)$", line)
        if not m:
            return "no 'value X at [...] ... = B' in the message"
        if float(m.group(1)) != float(gval) or not float(m.group(1)) < float(m.group(2)):
            return f"printed value {m.group(1)} is not g = {float(gval)!r} below the bound {m.group(2)}"
        return None
    return problem


# The promised bound at exactly -5 (float32 and float64), and one ulp below it.
for dtype in (f32, f64):
    x = kda_inputs(1, 70, 1, 1, 16, 8, dtype=dtype, gate=(-5, -4))
    x["g"][0, ::3] = dtype(-5)
    lab = f"kda g = -5 with --gate-lower-bound -5 {np.dtype(dtype).name}"
    tf, tb = (1e-12, 1e-10) if dtype == f64 else (2e-5, 2e-4)
    kda_case(lab, x, modes=("chunk",), extra_opts=["--gate-lower-bound", "-5"], tol_f=tf, tol_b=tb)
    x["g"][0, 33, 0, 5] = np.nextafter(dtype(-5), dtype(-6))
    d = ck.newdir()
    write(d, x)
    if ck.want("kda bad: g below bound"):
        error_case(f"kda bad: g one ulp below -5 {np.dtype(dtype).name}", d, ["--gate-lower-bound", "-5"], "--gate-lower-bound",
                   not_mention="gate_lower_bound", line_ok=value_below_bound(x["g"][0, 33, 0, 5]))
        error_case(f"kda bad: --gate-lower-bound 0 {np.dtype(dtype).name}", d, ["--gate-lower-bound", "0"], "--gate-lower-bound", not_mention="gate_lower_bound")

# No decay (g = 0) over one long float32 sequence, normalised k, beta in (0, 1): bounded state.
if ck.want("kda long no decay"):
    x = kda_inputs(1, 3000, 1, 1, 16, 16, dtype=f32, gate=(0, 0), h0=False)
    kda_case("kda long no decay f32", x, backward=False, tol_f=2e-5)

# An exploding state: k not normalised (|k|^2 ~ 25 K), beta = 1: the transition's eigenvalue
# 1 - |k|^2 grows the state geometrically until it overflows. Both modes must agree with the
# float64 reference while finite; after the overflow the values are Inf/NaN, confined to the head.
if ck.want("kda overflow"):
    x = kda_inputs(1, 160, 1, 2, 4, 3, dtype=f32, gate=(0, 0), h0=False)
    x["k"] = (rng.standard_normal(x["k"].shape) * 5).astype(f32)
    x["beta"][..., 0] = 1
    x["beta"][..., 1] = 0  # value head 1 never writes: stays 0, must stay finite
    for mode in ("chunk", "recurrent"):
        d = ck.newdir()
        write(d, x)
        r = run(f"kda overflow {mode}", d, ["--mode", mode])
        if r is None:
            continue
        o = r["o"].astype(f64)
        if not np.all(o[0, :, 1] == 0) or not np.all(r["ht"][0, 1] == 0):
            ck.fail(f"kda overflow {mode}", "the non-writing value head is not exactly 0")
        elif np.all(np.isfinite(o[0, :, 0])):
            ck.fail(f"kda overflow {mode}", "expected the exploding head to overflow in float32")
        else:
            ck.ok(f"kda overflow {mode}")
        o_ref, _ = kda_ref({n: (None if a is None else a.astype(f64)) for n, a in x.items()}, 0.5, None)
        first = int(np.argmax(~np.isfinite(o[0, :, 0]).any(-1)))  # first token with a non-finite o
        # Before the overflow the float32 result tracks the float64 reference (relative to the
        # growing magnitude, a few thousand float32 ulps after ~10 doublings of error).
        fin = slice(0, max(first - 2, 1))
        check(f"kda overflow {mode} before", "o", o[0, fin, 0], o_ref[0, fin, 0], 1e-3)

# ---------------------------------------------------------------------------------------------
# NaN in one value head stays in that head (q/k heads shared by a group G = 2: value heads 0,1
# read head 0, value heads 2,3 head 1). A NaN in v of value head 3 must leave heads 0..2 exact.
if ck.want("kda nan"):
    x = kda_inputs(1, 150, 2, 4, 8, 6)
    xn = {n: (None if a is None else a.copy()) for n, a in x.items()}
    xn["v"][0, 70, 3, 2] = np.nan
    do = rng.standard_normal((1, 150, 4, 6))
    dh = rng.standard_normal((1, 4, 8, 6))
    for mode in ("chunk", "recurrent"):
        rs = []
        for y in (x, xn):
            d = ck.newdir()
            write(d, y, extra={"do": do, "dht": dh})
            rs.append(run(f"kda nan head {mode}", d, ["--mode", mode, "--backward"]))
        if None in rs:
            continue
        a, b = rs
        bad = []
        for nm, ax in (("o", 2), ("ht", 1), ("dv", 2), ("dg", 2), ("dbeta", 2), ("dh0", 1)):
            keep = np.take(b[nm], [0, 1, 2], axis=ax)
            if not np.array_equal(keep, np.take(a[nm], [0, 1, 2], axis=ax)):
                bad.append(nm + " (other heads changed)")
        for nm in ("dq", "dk"):  # q/k head 0 only feeds value heads 0, 1
            if not np.array_equal(b[nm][:, :, 0], a[nm][:, :, 0]):
                bad.append(nm + " head 0 changed")
        if np.all(np.isfinite(b["o"][0, 70:, 3])) or np.any(~np.isfinite(b["o"][0, :70, 3])):
            bad.append("o of head 3: NaN not exactly from token 70 on")
        (ck.fail(f"kda nan head {mode}", "; ".join(bad)) if bad else ck.ok(f"kda nan head {mode}"))

# NaN in one packed sequence (in v, h0 or do) leaves the other sequences bit for bit unchanged,
# forward and gradients, for sequences shorter than a chunk packed next to each other.
def nan_sequence_case(cmd, modes, make, vname, gnames):
    cu = np.array([0, 5, 14, 17, 57], np.int64)
    x = make()
    HV, V = x["v"].shape[2:]
    do = rng.standard_normal((1, 57, HV, V))
    dh = rng.standard_normal(x["h0"].shape)
    for where in ("v", "h0", "do"):
        for mode in modes:
            lab = f"{cmd} nan in sequence 1 ({where}) {mode}"
            if not ck.want(lab):
                continue
            rs = []
            for poison in (False, True):
                y = {n: a.copy() for n, a in x.items()}
                dd = do.copy()
                if poison:
                    {"v": lambda: y["v"].__setitem__((0, 8, 0, 1), np.nan), "h0": lambda: y["h0"].__setitem__((1, 0, 0, 0), np.nan),
                     "do": lambda: dd.__setitem__((0, 9, 0, 0), np.nan)}[where]()
                d = ck.newdir()
                write(d, y, cu, np.int64, {"do": dd, "dht": dh})
                rs.append(run(lab, d, ["--mode", mode, "--backward"], cmd=cmd))
            if None in rs:
                continue
            a, b = rs
            bad = []
            for nm in a:
                if nm in ("ht", "dh0"):
                    keep = [0, 2, 3]
                    if not np.array_equal(a[nm][keep], b[nm][keep]):
                        bad.append(nm)
                else:
                    tok = np.r_[0:5, 14:57]
                    if not np.array_equal(a[nm][:, tok], b[nm][:, tok]):
                        bad.append(nm)
            if where != "do" and np.all(np.isfinite(b["ht"][1])):
                bad.append("ht of sequence 1 finite")
            (ck.fail(lab, "other sequences changed: " + ", ".join(bad)) if bad else ck.ok(lab))


nan_sequence_case("kda", ("chunk", "recurrent"), lambda: kda_inputs(1, 57, 1, 2, 6, 4, N=4), "v", None)


# ---------------------------------------------------------------------------------------------
# Fortran order everywhere, with bfloat16 inputs: the same bytes out as C order.
if ck.want("kda fortran"):
    x = kda_inputs(1, 40, 2, 2, 5, 3, N=3)
    cu = np.array([0, 11, 11, 40], np.int32)
    do = rng.standard_normal((1, 40, 2, 3))
    dh = rng.standard_normal((3, 2, 5, 3)).astype(f32)
    got = []
    for order in ("C", "F"):
        d = ck.newdir()
        for n, a in list(x.items()) + [("do", do)]:
            a = a.astype(f32 if n == "h0" else bf16)
            np.save(os.path.join(d, "in", n + ".npy"), np.asfortranarray(a) if order == "F" else a)
        np.save(os.path.join(d, "in", "dht.npy"), np.asfortranarray(dh) if order == "F" else dh)
        np.save(os.path.join(d, "in", "cu_seqlens.npy"), cu)
        got.append(run(f"kda fortran bf16 {order}", d, ["--backward"]))
    if None not in got:
        diff = [n for n in got[0] if got[0][n].tobytes() != got[1][n].tobytes() or got[0][n].dtype != got[1][n].dtype]
        (ck.fail("kda fortran bf16", f"outputs differ from C order: {diff}") if diff else ck.ok("kda fortran bf16"))

# ---------------------------------------------------------------------------------------------
# Bad input: one clear line naming what the user gave.

def kda_bad(label, mutate, opts=(), mention=None, not_mention=None, backward=False):
    if not ck.want(label):
        return
    x = kda_inputs(1, 12, 1, 2, 4, 3, N=2)
    files = dict(x)
    files["cu_seqlens"] = np.array([0, 5, 12], np.int64)
    if backward:
        files["do"] = np.zeros((1, 12, 2, 3))
        files["dht"] = np.zeros((2, 2, 4, 3))
    mutate(files)
    d = ck.newdir()
    for n, a in files.items():
        if a is not None:
            save(d, n, a)
    error_case(label, d, list(opts) + (["--backward"] if backward else []), mention, not_mention=not_mention)


def setf(name, value):
    return lambda f: f.__setitem__(name, value)


kda_bad("kda bad: q bf16 with h0 float64", lambda f: [f.__setitem__(n, f[n].astype(bf16)) for n in ("q", "k", "v", "g", "beta")], (), "h0")
kda_bad("kda bad: q '<u2' with k float32", lambda f: [f.__setitem__("q", f["q"].astype(bf16).view(np.uint16)), f.__setitem__("k", f["k"].astype(f32)),
                                               f.__setitem__("h0", f["h0"].astype(f32))], (), "'k'")
kda_bad("kda bad: dht float32 with float64 inputs", lambda f: f.__setitem__("dht", f["dht"].astype(f32)), (), "dht", backward=True)
kda_bad("kda bad: do float32 with float64 inputs", lambda f: f.__setitem__("do", f["do"].astype(f32)), (), "do", backward=True)
for cdt in (np.uint32, np.int16, np.uint64, np.bool_, np.uint8):
    kda_bad(f"kda bad: cu_seqlens {np.dtype(cdt).name}", lambda f, c=cdt: f.__setitem__("cu_seqlens", f["cu_seqlens"].astype(c)), (), "cu_seqlens")
kda_bad("kda bad: cu_seqlens 0-d", setf("cu_seqlens", np.array(12, np.int64)), (), "cu_seqlens")
kda_bad("kda bad: cu_seqlens int32 overflowing -1", setf("cu_seqlens", np.array([0, -1, 12], np.int32)), (), "cu_seqlens")
kda_bad("kda bad: q 0-d", setf("q", np.array(1.0)), (), "'q'")
kda_bad("kda bad: q 1-d", setf("q", np.zeros(48)), (), "'q'")
kda_bad("kda bad: beta 4-d", setf("beta", np.zeros((1, 12, 2, 1))), (), "beta")
kda_bad("kda bad: g 3-d", setf("g", np.zeros((1, 12, 2))), (), "'g'")
kda_bad("kda bad: h0 0-d", setf("h0", np.array(0.0)), (), "h0")
kda_bad("kda bad: dht 1-d", setf("dht", np.zeros(24)), (), "dht", backward=True)
kda_bad("kda bad: missing k", setf("k", None), (), "k")
kda_bad("kda bad: missing do with --backward", setf("do", None), (), "do", backward=True)
kda_bad("kda bad: h0 for B sequences, cu_seqlens for 2", setf("h0", np.zeros((1, 2, 4, 3))), (), "h0")
for s in ("nan", "inf", "-inf", "1e400"):
    kda_bad(f"kda bad: --scale {s}", lambda f: None, ["--scale", s], "--scale", not_mention="option 'scale'")
kda_bad("kda bad: --gate-lower-bound nan", lambda f: None, ["--gate-lower-bound", "nan"], "--gate-lower-bound", not_mention="gate_lower_bound")

# --scale 0 / negative are valid: o = 0 and dq = 0, resp. o linear in the scale.
if ck.want("kda scale"):
    x = kda_inputs(1, 30, 1, 1, 5, 4)
    rs = {}
    for s in ("0", "-0.5", "0.5"):
        d = ck.newdir()
        write(d, x, extra={"do": np.ones((1, 30, 1, 4))})
        rs[s] = run(f"kda --scale {s}", d, ["--scale", s, "--backward"])
    if None not in rs.values():
        ok = (np.all(rs["0"]["o"] == 0) and np.all(rs["0"]["dq"] == 0) and np.array_equal(rs["-0.5"]["o"], -rs["0.5"]["o"])
              and np.array_equal(rs["0"]["ht"], rs["0.5"]["ht"]))
        (ck.ok if ok else lambda l: ck.fail(l, "o/dq not zero for --scale 0, or o not odd in the scale"))("kda scale 0 / sign")

# Files the call does not use are ignored: dht/do without --backward (even of another dtype or
# one k3 cannot read: `k3 kda` once refused a stale float64 dht.npy next to float32 inputs),
# an unrelated extra .npy.
for cmd in ("kda", "dplr"):
    if not ck.want(f"{cmd} extra files"):
        continue
    x = kda_inputs(1, 20, 1, 1, 4, 4, dtype=f32)
    if cmd == "dplr":
        x = {"q": x["q"], "k": x["k"], "v": x["v"], "a": x["k"], "b": -x["k"], "gk": x["g"], "h0": x["h0"]}
    rs = []
    for extra in ({}, {"do": np.ones(3, np.int8), "dht": np.ones(2), "z": np.ones(1)}, {"dht": np.ones(2, np.int8)}):
        d = ck.newdir()
        write(d, x, extra=extra)
        rs.append(run(f"{cmd} extra files {sorted(extra)}", d, cmd=cmd))
    if None not in rs:
        (ck.ok if all(np.array_equal(r[n], rs[0][n]) for r in rs[1:] for n in rs[0]) and all(set(rs[0]) == set(r) for r in rs)
         else lambda l: ck.fail(l, "extra files changed the outputs"))(f"{cmd} extra files ignored")

# ---------------------------------------------------------------------------------------------
# DPLR: every option at once; chunk sizes that do not divide T, tiny and larger than T.

def dplr_inputs(B, T, H, K, V, N=None, dtype=f64, h0=True):
    a = l2n(rng.standard_normal((B, T, H, K)))
    x = {"q": rng.standard_normal((B, T, H, K)), "k": rng.standard_normal((B, T, H, K)) * 0.5,
         "v": rng.standard_normal((B, T, H, V)), "a": a, "b": -a * rng.uniform(0, 1, (B, T, H, 1)),
         "gk": rng.uniform(-0.5, 0, (B, T, H, K)), "h0": rng.standard_normal((B if N is None else N, H, K, V)) if h0 else None}
    return {n: (None if y is None else y.astype(dtype)) for n, y in x.items()}


def dplr_case(label, x, cu, opts, scale, cu_dtype=np.int32, tol_f=1e-12, tol_b=1e-10):
    if not ck.want(label):
        return None
    B, T, H, K = x["q"].shape
    V = x["v"].shape[3]
    N = B if cu is None else len(cu) - 1
    do = rng.standard_normal((B, T, H, V))
    dh = rng.standard_normal((N, H, K, V))
    d = ck.newdir()
    write(d, x, cu, cu_dtype, {"do": do, "dht": dh})
    r = run(label, d, list(opts) + ["--scale", repr(scale), "--backward"], cmd="dplr")
    if r is None:
        return None
    x64 = {n: (None if a is None else a.astype(f64)) for n, a in x.items()}
    o_ref, ht_ref = dplr_ref(x64, scale, cu)
    check(label, "o", r["o"], o_ref, tol_f)
    check(label, "ht", r["ht"], ht_ref, tol_f)
    res = directional(lambda y: dplr_ref(y, scale, cu), x64, DPLR_IN, do, dh, 1)
    check_grads(label, res, r, DPLR_GRAD, tol_b)
    return r


cu = [0, 0, 3, 3, 50, 117, 117]
x = dplr_inputs(1, 117, 2, 7, 5, N=len(cu) - 1)
outs = {}
for cs in (1, 7, 16, 48, 200):
    for ls in ("value-split", "segment-maps"):
        lab = f"dplr all options chunk {cs} {ls}"
        outs[lab] = dplr_case(lab, x, cu, ["--chunk-size", str(cs), "--long-sequence", ls, "--threads", "3"], -0.8,
                              cu_dtype=np.int32 if cs % 2 else np.int64)
outs["rec"] = dplr_case("dplr all options recurrent", x, cu, ["--mode", "recurrent", "--threads", "2"], -0.8)
if outs.get("rec") is not None:
    for n in (0, 2, 5):
        (ck.ok if np.array_equal(outs["rec"]["ht"][n], x["h0"][n]) else lambda l: ck.fail(l, "ht != h0"))(f"dplr empty sequence {n}")
dplr_case("dplr chunk size 2^40 (one chunk)", dplr_inputs(1, 30, 1, 4, 3), None, ["--chunk-size", str(1 << 40)], 0.7)
dplr_case("dplr long single sequence segment-maps", dplr_inputs(1, 400, 1, 3, 2, h0=True), None,
          ["--long-sequence", "segment-maps", "--threads", "4", "--chunk-size", "32"], 1.0)


# Zero-width heads (K = 0 or V = 0): an empty state, so o = 0, every gradient 0, dh0 = dht.
for K, V in ((0, 3), (3, 0)):
    for cmd in ("kda", "dplr"):
        for mode in (("automatic", "chunk", "recurrent") if cmd == "kda" else ("chunk", "chunked", "recurrent")):
            lab = f"{cmd} zero width K={K} V={V} {mode}"
            if not ck.want(lab):
                continue
            x = kda_inputs(1, 20, 1, 2, K, V, N=2) if cmd == "kda" else dplr_inputs(1, 20, 1, K, V, N=2)
            HV = x["v"].shape[2]
            dh = rng.standard_normal((2, HV, K, V))
            d = ck.newdir()
            write(d, x, [0, 7, 20], np.int32, {"do": np.ones((1, 20, HV, V)), "dht": dh})
            r = run(lab, d, ["--mode", mode, "--backward"], cmd=cmd)
            if r is None:
                continue
            grads = [n for n in r if n.startswith("d") and n != "dh0"]
            ok = (np.all(r["o"] == 0) and r["o"].shape == (1, 20, HV, V) and r["ht"].shape == (2, HV, K, V)
                  and np.array_equal(r["dh0"], dh) and all(np.all(r[n] == 0) for n in grads))
            (ck.ok if ok else lambda l: ck.fail(l, "o or a gradient not 0, or dh0 != dht"))(lab)


nan_sequence_case("dplr", ("chunked", "recurrent"), lambda: dplr_inputs(1, 57, 1, 6, 4, N=4), "v", None)


# Fortran order for every bfloat16 input of `k3 dplr` (widened to float32 by the tool itself),
# cu_seqlens, h0, do and dht: the same bytes out as C order.
if ck.want("dplr fortran"):
    x = dplr_inputs(1, 40, 2, 5, 3, N=3)
    cu = np.array([0, 11, 11, 40], np.int32)
    do = rng.standard_normal((1, 40, 2, 3))
    dh = rng.standard_normal((3, 2, 5, 3)).astype(f32)
    got = []
    for order in ("C", "F"):
        d = ck.newdir()
        for n, a in list(x.items()) + [("do", do), ("dht", dh), ("cu_seqlens", cu)]:
            a = a if n in ("dht", "cu_seqlens") else a.astype(f32 if n == "h0" else bf16)
            np.save(os.path.join(d, "in", n + ".npy"), np.asfortranarray(a) if order == "F" else a)
        got.append(run(f"dplr fortran bf16 {order}", d, ["--backward", "--chunk-size", "16"], cmd="dplr"))
    if None not in got:
        diff = [n for n in got[0] if got[0][n].tobytes() != got[1][n].tobytes() or got[0][n].dtype != got[1][n].dtype]
        (ck.fail("dplr fortran bf16", f"outputs differ from C order: {diff}") if diff else ck.ok("dplr fortran bf16"))


def dplr_bad(label, mutate, opts=(), mention=None):
    if not ck.want(label):
        return
    files = dplr_inputs(1, 10, 1, 3, 2, N=2)
    files["cu_seqlens"] = np.array([0, 4, 10], np.int32)
    mutate(files)
    d = ck.newdir()
    for n, a in files.items():
        if a is not None:
            save(d, n, a)
    error_case(label, d, opts, mention, cmd="dplr")


for cs in ("0", "-3"):
    dplr_bad(f"dplr bad: --chunk-size {cs}", lambda f: None, ["--chunk-size", cs], "--chunk-size")
dplr_bad("dplr bad: --long-sequence foo", lambda f: None, ["--long-sequence", "foo"], "--long-sequence")
dplr_bad("dplr bad: --scale nan", lambda f: None, ["--scale", "nan"], "scale")
dplr_bad("dplr bad: a float32 with float64 q", lambda f: f.__setitem__("a", f["a"].astype(f32)), (), "'a'")
dplr_bad("dplr bad: q bf16, gk float32", lambda f: [f.__setitem__(n, f[n].astype(bf16)) for n in ("q", "k", "v", "a", "b")], (), "gk")
dplr_bad("dplr bad: h0 float32 with float64 q", lambda f: f.__setitem__("h0", f["h0"].astype(f32)), (), "h0")
dplr_bad("dplr bad: cu_seqlens uint32", lambda f: f.__setitem__("cu_seqlens", f["cu_seqlens"].astype(np.uint32)), (), "cu_seqlens")
dplr_bad("dplr bad: cu_seqlens 0-d", lambda f: f.__setitem__("cu_seqlens", np.array(10, np.int32)), (), "cu_seqlens")
dplr_bad("dplr bad: gk 1-d", lambda f: f.__setitem__("gk", np.zeros(30)), (), "gk")
dplr_bad("dplr bad: b 0-d", lambda f: f.__setitem__("b", np.array(1.0)), (), "'b'")
dplr_bad("dplr bad: missing a", lambda f: f.__setitem__("a", None), (), "a.npy")

ck.finish()
