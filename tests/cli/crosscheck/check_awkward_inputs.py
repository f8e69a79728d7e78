"""Numeric cross-check of the k3 CLI on VALID but awkward inputs (numbers, not malformed files).

Own float64 references, written from the specs (/work/shared/spec) and independent of the other
check_*.py scripts. Two parts:
  * regressions for wrong numbers this checker found:
      - NVFP4: a tensor of normal floats with amax < 3.2e-35 got tensor scale g = 1 and quantised
        to all zeros (the underflow guard cut at FLT_MIN);
      - route: the "+ 1e-20" in the weight renormalisation shrank every weight when the chosen
        scores summed below ~1e-13 (scores 1e-30: weights 1e-10 instead of 1/k);
      - attnres --backward: dw and dgain differed in the last bits of double between --threads 1/2/3;
  * a quick sweep of every subcommand on awkward shapes and values (T = 1, odd head dims, grouped
    value heads, varlen with empty and length-1 sequences, strong decays, beta = 2, magnitudes
    1e-30..1e20, format boundary values, ties), so these stay covered.
Run: python3 tests/cli/crosscheck/run.py tests/cli/crosscheck/check_awkward_inputs.py --k3 build/examples/k3
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Checker, rel_rms, save  # noqa: E402

import ml_dtypes  # noqa: E402

ck = Checker("awkward_inputs")
rng = np.random.default_rng(2026 + ck.args.seeds)
f32 = np.float32


def run(label, cmd, d, opts=()):
    rc, text, c = ck.run(d, list(opts), cmdname=cmd)
    if rc != 0:
        ck.fail(label, f"exit {rc}: {text.strip()[:300]}", c)
        return None
    out = {}
    for f in os.listdir(os.path.join(d, "out")):
        out[f[:-4]] = ck.out(d, f[:-4])
    return out


def inputs(d, **arrs):
    for k, v in arrs.items():
        save(d, k, v)


def check_rel(label, name, got, ref, tol):
    e = rel_rms(got, ref)
    if not (e <= tol):
        ck.fail(label, f"{name}: rel-RMS {e:.3e} > {tol:.1e}")
    else:
        ck.ok(f"{label} {name} {e:.1e}")


def check_equal(label, name, got, ref):
    got, ref = np.asarray(got), np.asarray(ref)
    if got.shape != ref.shape or not np.array_equal(got, ref, equal_nan=got.dtype.kind == "f"):
        bad = np.argwhere(got != ref)[:3].tolist() if got.shape == ref.shape else "shape"
        ck.fail(label, f"{name}: differs from the reference (first at {bad})")
    else:
        ck.ok(f"{label} {name}")


# ---------------------------------------------------------------- element formats (own tables)
FMT = {"e4m3": (4, 3, 7, True, False), "e5m2": (5, 2, 15, False, True), "e3m2": (3, 2, 3, False, False),
       "e2m3": (2, 3, 1, False, False), "e2m1": (2, 1, 1, False, False)}
EMAX = {"e4m3": 8, "e5m2": 15, "e3m2": 4, "e2m3": 2, "e2m1": 2}


def table(name):
    E, M, bias, e4, ieee = FMT[name]
    vals = []
    for c in range(1 << (E + M)):
        e, m = c >> M, c & ((1 << M) - 1)
        if e4 and e == (1 << E) - 1 and m == (1 << M) - 1:
            vals.append(np.nan)
        elif ieee and e == (1 << E) - 1:
            vals.append(np.inf if m == 0 else np.nan)
        elif e == 0:
            vals.append(2.0 ** (1 - bias) * m / (1 << M))
        else:
            vals.append(2.0 ** (e - bias) * (1 + m / (1 << M)))
    return np.array(vals)


TAB = {n: table(n) for n in FMT}
MAX = {n: np.nanmax(TAB[n][np.isfinite(TAB[n])]) for n in FMT}


def encode(name, x):
    """Saturating round-to-nearest-even by search over the value table (ties: even code)."""
    t = TAB[name]
    E, M = FMT[name][:2]
    fin = np.nonzero(np.isfinite(t))[0]
    order = np.argsort(t[fin])
    pv, pc = t[fin][order], fin[order]
    x = np.asarray(x, np.float64)
    a = np.minimum(np.abs(x), MAX[name])
    i = np.clip(np.searchsorted(pv, a), 1, len(pv) - 1)
    dlo, dhi = a - pv[i - 1], pv[i] - a
    code = np.where((dhi < dlo) | ((dhi == dlo) & (pc[i] % 2 == 0)), pc[i], pc[i - 1])
    code = np.where(a <= pv[0], pc[0], code) | np.where(np.signbit(x), 1 << (E + M), 0)
    return code.astype(np.uint8)


def decode(name, c):
    E, M = FMT[name][:2]
    c = np.asarray(c).astype(np.int64)
    v = TAB[name][c & ((1 << (E + M)) - 1)]
    return np.where(c & (1 << (E + M)), -v, v)


def e8m0_ceil(v):
    b = np.array(v, f32).view(np.uint32).astype(np.int64)
    e, man = (b >> 23) & 0xFF, b & 0x7FFFFF
    return int(np.where(e == 0, np.where(man > 0x400000, 1, 0), np.where((man != 0) & (e != 0xFE), e + 1, e)))


def ds_ref(x, tr, tc, ue8m0):
    M, K = x.shape
    codes, y = np.zeros((M, K), np.uint8), np.zeros((M, K), f32)
    S = np.zeros((-(-M // tr), -(-K // tc)), f32)
    for a in range(S.shape[0]):
        for b in range(S.shape[1]):
            sl = np.s_[a * tr:(a + 1) * tr, b * tc:(b + 1) * tc]
            am = np.max(np.abs(x[sl]))
            if not np.isfinite(am):
                S[a, b], codes[sl], y[sl] = np.nan, 0x7F, np.nan
                continue
            s = f32(max(am, f32(1e-4))) / f32(448)
            if ue8m0:
                s = f32(2.0 ** (min(max(e8m0_ceil(s), 1), 254) - 127))
            c = encode("e4m3", (x[sl] * (f32(1) / s)).astype(f32))
            codes[sl], S[a, b], y[sl] = c, s, (decode("e4m3", c).astype(f32) * s).astype(f32)
    return codes, S, y


def mx_ref(x, el, rule):
    M, K = x.shape
    codes, S, y = np.zeros((M, K), np.uint8), np.zeros((M, K // 32), np.uint8), np.zeros((M, K), f32)
    for i in range(M):
        for b in range(K // 32):
            sl = np.s_[i, b * 32:(b + 1) * 32]
            am = np.max(np.abs(x[sl]))
            if not np.isfinite(am):
                S[i, b], y[sl] = 0xFF, np.nan
                continue
            if rule == "floor":
                se = -127 if am == 0 else int(np.frexp(np.float64(am))[1]) - 1 - EMAX[el]
            else:
                se = e8m0_ceil(f32(am) / f32(MAX[el])) - 127
            se = max(se, -127)
            c = encode(el, (x[sl] * f32(2.0 ** -se)).astype(f32))
            S[i, b], codes[sl], y[sl] = se + 127, c, (decode(el, c) * 2.0 ** se).astype(f32)
    return codes, S, y


def nv_ref(x):
    M, K = x.shape
    fin = np.abs(x[np.isfinite(x)])
    g = f32(f32(fin.max() if fin.size else 0) / f32(448 * 6))
    if not g >= f32(2.0 ** -140):  # documented: all-zero tensors (and subnormal-scale ones) get g = 1
        g = f32(1)
    codes, S, y = np.zeros((M, K), np.uint8), np.zeros((M, K // 16), np.uint8), np.zeros((M, K), f32)
    for i in range(M):
        for b in range(K // 16):
            sl = np.s_[i, b * 16:(b + 1) * 16]
            bam = np.max(np.abs(x[sl]))
            if not np.isfinite(bam):
                S[i, b], y[sl] = 0x7F, np.nan
                continue
            r = f32(min(max(f32(f32(bam / f32(6)) / g), f32(2.0 ** -6)), f32(448)))
            sc = encode("e4m3", r)[()]
            div = f32(g * f32(decode("e4m3", sc)))
            c = encode("e2m1", (x[sl] / div).astype(f32))
            S[i, b], codes[sl], y[sl] = sc, c, (decode("e2m1", c).astype(f32) * div).astype(f32)
    return codes, S, y, g


def unpack4(p, K):
    out = np.zeros(p.shape[:-1] + (K,), np.uint8)
    out[..., 0::2], out[..., 1::2] = p & 0xF, p >> 4
    return out


# ---------------------------------------------------------------- regression 1: NVFP4 tiny tensors
if ck.want("nvfp4 tiny"):
    base = rng.standard_normal((3, 64)).astype(f32)
    for e2 in (-100, -118, -122, -126, -128):
        x = (base * f32(2.0 ** e2)).astype(f32)  # exact scaling; 2^-126..-128: amax ~ 1e-38, partly subnormal
        label = f"nvfp4 tiny 2^{e2}"
        d = ck.newdir()
        inputs(d, x=x)
        r = run(label, "quant", d, ["--format", "nvfp4"])
        if r is None:
            continue
        c, S, y, g = nv_ref(x)
        check_equal(label, "tensor_scale", r["tensor_scale"], np.array([g], f32))
        check_equal(label, "codes", unpack4(r["codes"], 64), c)
        check_equal(label, "scales", r["scales"], S)
        check_equal(label, "dequant", r["dequant"], y)
        if e2 >= -122:  # g stays a normal or well-resolved subnormal float: FP4-size error, not all zeros
            check_rel(label, "dequant vs x", r["dequant"], x, 0.2)

# ---------------------------------------------------------------- regression 2: route weights at tiny scores
def route_ref(s, b, k, scale):
    z = (s + b[None]).astype(f32)
    m, n = s.shape
    idx, w = np.zeros((m, k), np.int64), np.zeros((m, k))
    for i in range(m):
        order = sorted(range(n), key=lambda j: (-float(z[i, j]), j))[:k]
        sel = s[i, order].astype(np.float64)
        idx[i], w[i] = order, (sel / sel.sum() * scale if sel.sum() > 0 else 0)
    return idx, w


if ck.want("route tiny"):
    for (m, n, k) in ((9, 5, 2), (40, 40, 16), (3, 20, 19)):
        s = rng.uniform(0, 1, (m, n)).astype(f32)
        for sc in (1.0, 2.0 ** -100, 2.0 ** -60):
            label = f"route tiny m{m} n{n} k{k} x{sc:.0e}"
            t = (s * f32(sc)).astype(f32)
            d = ck.newdir()
            inputs(d, scores=t)
            r = run(label, "route", d, ["--k", str(k), "--scale", "2.5", "--update", "exact"])
            if r is None:
                continue
            idx, w = route_ref(t, np.zeros(n, f32), k, 2.5)
            check_equal(label, "indices", r["indices"], idx.astype(np.int32))
            check_rel(label, "weights", r["weights"], w, 1e-6)
    d = ck.newdir()
    inputs(d, scores=np.array([[0, 0, 0.5, 0]], f32), bias=np.array([1, 1, 0, 0], f32))
    r = run("route zero-score choice", "route", d, ["--k", "2", "--update", "exact"])
    if r is not None:
        check_equal("route zero-score choice", "weights", r["weights"], np.zeros((1, 2), f32))

# ---------------------------------------------------------------- sweep: KDA
def kda_ref(q, k, v, g, beta, scale=None, h0=None, cu=None):
    q, k, v, g, beta = (a.astype(np.float64) for a in (q, k, v, g, beta))
    B, T, H, K = q.shape
    HV, V = v.shape[2:]
    G = HV // H
    scale = K ** -0.5 if scale is None else scale
    seqs = [(b, 0, T) for b in range(B)] if cu is None else [(0, int(cu[i]), int(cu[i + 1])) for i in range(len(cu) - 1)]
    o, ht = np.zeros((B, T, HV, V)), np.zeros((len(seqs), HV, K, V))
    for n, (b, s0, s1) in enumerate(seqs):
        S = np.zeros((HV, K, V)) if h0 is None else h0[n].astype(np.float64).copy()
        for t in range(s0, s1):
            kt = np.repeat(k[b, t], G, axis=0)
            S = np.exp(g[b, t])[:, :, None] * S
            S = S + beta[b, t][:, None, None] * kt[:, :, None] * (v[b, t] - np.einsum("hkv,hk->hv", S, kt))[:, None, :]
            o[b, t] = np.einsum("hkv,hk->hv", S, scale * np.repeat(q[b, t], G, axis=0))
        ht[n] = S
    return o, ht


def kda_case(B, T, H, HV, K, V, dt, gate="normal", beta_max=1.0, cu=None, vscale=1.0):
    q, k = rng.standard_normal((B, T, H, K)), rng.standard_normal((B, T, H, K))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = np.log(1 / (1 + np.exp(-rng.standard_normal((B, T, HV, K))))) / 8
    if gate == "lb5":
        g = -5 * rng.uniform(0, 1, g.shape)
        g[rng.uniform(size=g.shape) < 0.2] = -5.0
    elif gate == "zero":
        g[:] = 0
    elif gate == "strong":
        g = -rng.uniform(0, 30, g.shape)
    N = B if cu is None else len(cu) - 1
    a = dict(q=q, k=k, v=rng.standard_normal((B, T, HV, V)) * vscale, g=g, beta=rng.uniform(0, beta_max, (B, T, HV)),
             h0=rng.standard_normal((N, HV, K, V)) * vscale)
    return {n: x.astype(dt) for n, x in a.items()}


if ck.want("kda"):
    cases = [((1, 1, 1, 1, 16, 16), {}), ((2, 17, 1, 2, 3, 5), {}), ((1, 65, 2, 2, 129, 17), {}), ((1, 129, 1, 4, 17, 100), {"gate": "lb5"}),
             ((1, 70, 1, 2, 16, 16), {"gate": "strong"}), ((1, 70, 1, 1, 8, 8), {"gate": "zero", "beta_max": 2.0}),
             ((1, 150, 2, 4, 17, 9), {"cu": [0, 0, 1, 1, 17, 17, 140, 150]}), ((1, 64, 1, 1, 16, 16), {"vscale": 1e20}),
             ((1, 64, 1, 1, 16, 16), {"vscale": 1e-30})]
    for dt, tol in ((np.float64, 1e-12), (f32, 1e-5)):
        for shape, kw in cases:
            a = kda_case(*shape, dt, **kw)
            ro, rh = kda_ref(a["q"], a["k"], a["v"], a["g"], a["beta"], None, a["h0"], kw.get("cu"))
            for mode in ("chunk", "recurrent"):
                label = f"kda {dt.__name__} {mode} {shape} {kw}"
                d = ck.newdir()
                inputs(d, **a)
                if "cu" in kw:
                    save(d, "cu_seqlens", np.array(kw["cu"], np.int32))
                opts = ["--mode", mode] + (["--gate-lower-bound", "-5"] if kw.get("gate") == "lb5" else [])
                r = run(label, "kda", d, opts)
                if r is not None:
                    check_rel(label, "o", r["o"], ro, tol)
                    check_rel(label, "ht", r["ht"], rh, tol)
    # gradients: directional finite differences of L = <o, do> + <ht, dht> in float64
    for mode in ("chunk", "recurrent"):
        a = kda_case(1, 70, 1, 2, 5, 3, np.float64, beta_max=2.0, cu=[0, 0, 1, 17, 70])
        a["q"] *= 0.5
        cu = [0, 0, 1, 17, 70]
        do, dht = rng.standard_normal(a["v"].shape), rng.standard_normal(a["h0"].shape)
        label = f"kda grad {mode}"
        d = ck.newdir()
        inputs(d, **a, do=do, dht=dht, cu_seqlens=np.array(cu, np.int64))
        r = run(label, "kda", d, ["--mode", mode, "--backward", "--scale", "0.7"])
        if r is None:
            continue
        for name in ("q", "k", "v", "g", "beta", "h0"):
            X = rng.standard_normal(a[name].shape)

            def loss(sgn, name=name, X=X):
                b = dict(a)
                b[name] = a[name] + sgn * 1e-5 * X
                o, ht = kda_ref(b["q"], b["k"], b["v"], b["g"], b["beta"], 0.7, b["h0"], cu)
                return np.sum(o * do) + np.sum(ht * dht)

            fd = (loss(1) - loss(-1)) / 2e-5
            an = np.sum(r["d" + name] * X)
            if abs(fd - an) > 1e-6 * max(abs(fd), 1e-8):
                ck.fail(label, f"d{name}: analytic {an:.10e} vs finite difference {fd:.10e}")
            else:
                ck.ok(f"{label} d{name}")

# ---------------------------------------------------------------- sweep: DPLR
def dplr_ref(q, k, v, a, b, gk, h0=None, cu=None):
    q, k, v, a, b, gk = (x.astype(np.float64) for x in (q, k, v, a, b, gk))
    B, T, H, K = q.shape
    V = v.shape[3]
    seqs = [(bb, 0, T) for bb in range(B)] if cu is None else [(0, int(cu[i]), int(cu[i + 1])) for i in range(len(cu) - 1)]
    o, ht = np.zeros((B, T, H, V)), np.zeros((len(seqs), H, K, V))
    for n, (bb, s0, s1) in enumerate(seqs):
        S = np.zeros((H, K, V)) if h0 is None else h0[n].astype(np.float64).copy()
        for t in range(s0, s1):
            aS = np.einsum("hk,hkv->hv", a[bb, t], S)
            S = np.exp(gk[bb, t])[:, :, None] * S + b[bb, t][:, :, None] * aS[:, None, :] + k[bb, t][:, :, None] * v[bb, t][:, None, :]
            o[bb, t] = np.einsum("hkv,hk->hv", S, K ** -0.5 * q[bb, t])
        ht[n] = S
    return o, ht


if ck.want("dplr"):
    for dt, tol in ((np.float64, 1e-12), (f32, 2e-5)):
        for (B, T, H, K, V, cu, reset) in ((1, 1, 1, 16, 16, None, False), (2, 15, 2, 3, 5, None, False), (1, 65, 1, 17, 129, None, True),
                                           (1, 300, 2, 16, 17, [0, 0, 1, 1, 20, 250, 300], False)):
            aa = rng.standard_normal((B, T, H, K))
            aa /= np.linalg.norm(aa, axis=-1, keepdims=True)
            gk = np.log(1 / (1 + np.exp(-rng.standard_normal((B, T, H, K))))) / 4
            if reset:
                gk[rng.uniform(size=gk.shape) < 0.05] = -1000
            N = B if cu is None else len(cu) - 1
            a = dict(q=rng.standard_normal((B, T, H, K)) * 0.3, k=rng.standard_normal((B, T, H, K)) * 0.3, v=rng.standard_normal((B, T, H, V)),
                     a=aa, b=-aa * rng.uniform(0, 1, (B, T, H, 1)), gk=gk, h0=rng.standard_normal((N, H, K, V)))
            a = {n: x.astype(dt) for n, x in a.items()}
            ro, rh = dplr_ref(a["q"], a["k"], a["v"], a["a"], a["b"], a["gk"], a["h0"], cu)
            for opts in (["--mode", "recurrent"], ["--threads", "1"], ["--threads", "3", "--chunk-size", "16"],
                         ["--threads", "2", "--long-sequence", "segment-maps", "--chunk-size", "32"]):
                label = f"dplr {dt.__name__} {(B, T, H, K, V, cu)} {' '.join(opts)}"
                d = ck.newdir()
                inputs(d, **a)
                if cu is not None:
                    save(d, "cu_seqlens", np.array(cu, np.int64))
                r = run(label, "dplr", d, opts)
                if r is not None:
                    check_rel(label, "o", r["o"], ro, tol)
                    check_rel(label, "ht", r["ht"], rh, tol)

# ---------------------------------------------------------------- sweep: AttnRes
def attnres_ref(src, w, gain, partial=None, eps=1e-5):
    S = src.astype(np.float64)
    if partial is not None:
        S = np.concatenate([S, partial.astype(np.float64)[None]], 0)
    s = np.einsum("ntd,d->nt", S, gain.astype(np.float64) * w.astype(np.float64)) / np.sqrt(np.mean(S ** 2, axis=-1) + eps)
    p = np.exp(s - s.max(0, keepdims=True))
    return np.einsum("nt,ntd->td", p / p.sum(0, keepdims=True), S)


if ck.want("attnres"):
    for kind, tol in (("f64", 1e-12), ("f32", 1e-6), ("bf16", 8e-3)):
        for (n, T, d_, part) in ((1, 1, 1, False), (2, 3, 7, True), (9, 17, 129, True), (30, 5, 33, False)):
            for scale in (1.0, 1e-30, 1e20):
                for eps in (1e-5, 0.0):
                    src = rng.standard_normal((n, T, d_)) * scale
                    partial = rng.standard_normal((T, d_)) * scale if part else None
                    pdt = np.float64 if kind == "f64" else f32
                    w, gain = rng.standard_normal(d_).astype(pdt), (1 + 0.3 * rng.standard_normal(d_)).astype(pdt)
                    if kind == "bf16":
                        cast = lambda x: x.astype(ml_dtypes.bfloat16).view(np.uint16)  # noqa: E731
                        back = lambda x: x.view(ml_dtypes.bfloat16).astype(np.float64)  # noqa: E731
                    else:
                        cast = (lambda x: x.astype(np.float64)) if kind == "f64" else (lambda x: x.astype(f32))  # noqa: E731
                        back = lambda x: x  # noqa: E731
                    label = f"attnres {kind} {(n, T, d_, part)} x{scale:g} eps {eps:g}"
                    dd = ck.newdir()
                    inputs(dd, sources=cast(src), w=w, gain=gain)
                    if part:
                        save(dd, "partial", cast(partial))
                    r = run(label, "attnres", dd, ["--eps", repr(eps), "--threads", "3"])
                    if r is not None:
                        ref = attnres_ref(back(cast(src)), w, gain, back(cast(partial)) if part else None, eps)
                        check_rel(label, "h", back(r["h"]) if kind == "bf16" else r["h"], ref, tol)

    # gradients bitwise the same for --threads 1/2/3 (dw, dgain are sums over tokens)
    for kind in ("f64", "f32"):
        pdt = np.float64 if kind == "f64" else f32
        n, T, d_ = 3, 300, 19
        ins = dict(sources=rng.standard_normal((n, T, d_)).astype(pdt), partial=rng.standard_normal((T, d_)).astype(pdt),
                   w=rng.standard_normal(d_).astype(pdt), gain=(1 + 0.3 * rng.standard_normal(d_)).astype(pdt), dh=rng.standard_normal((T, d_)).astype(pdt))
        outs = []
        for th in ("1", "2", "3"):
            dd = ck.newdir()
            inputs(dd, **ins)
            outs.append(run(f"attnres threads {kind} {th}", "attnres", dd, ["--backward", "--threads", th]))
        if all(o is not None for o in outs):
            for th, o in zip(("2", "3"), outs[1:]):
                for name in outs[0]:
                    check_equal(f"attnres {kind} --threads {th} vs 1", name, o[name], outs[0][name])

# ---------------------------------------------------------------- sweep: quant
if ck.want("quant"):
    def special(M, K):
        v = np.array([448., 464., 464.0001, 480., 57344., 61440., 6., 5., 7., 0.75, 2 ** -9, 2 ** -10, 0., 28., 7.5, 3.5, 2 ** -6, 1e-40])
        return (rng.choice(v, (M, K)) * rng.choice([1, -1], (M, K))).astype(f32)

    mats = {"normal": rng.standard_normal((5, 256)).astype(f32), "special": special(3, 128),
            "mixed": (rng.standard_normal((6, 64)) * 10.0 ** rng.integers(-40, 38, (6, 1))).astype(f32),
            "zeros": np.where(rng.uniform(size=(2, 96)) < 0.5, f32(0), f32(-0.0)).astype(f32),
            "nonfinite": rng.standard_normal((3, 64)).astype(f32), "odd": rng.standard_normal((129, 130)).astype(f32) * f32(1e6)}
    mats["nonfinite"][1, 5], mats["nonfinite"][2, 40] = np.nan, -np.inf
    for mname, x in mats.items():
        for blk, tr, tc in (("1x128", 1, 128), ("128x128", 128, 128), ("128x1", 128, 1)):
            for sc in ("fp32", "ue8m0"):
                label = f"quant {mname} e4m3 {blk} {sc}"
                d = ck.newdir()
                inputs(d, x=x)
                r = run(label, "quant", d, ["--format", "e4m3", "--block", blk, "--scale", sc])
                if r is not None:
                    c, S, y = ds_ref(x, tr, tc, sc == "ue8m0")
                    check_equal(label, "codes", r["codes"], c)
                    check_equal(label, "scales", r["scales"], S)
                    check_equal(label, "dequant", r["dequant"], y)
        if x.shape[1] % 32 == 0:
            for el, fmt in (("e4m3", "mxfp8"), ("e5m2", "mxfp8_e5m2"), ("e3m2", "mxfp6"), ("e2m3", "mxfp6_e2m3"), ("e2m1", "mxfp4")):
                for rule in ("floor", "rceil"):
                    label = f"quant {mname} {fmt} {rule}"
                    d = ck.newdir()
                    inputs(d, x=x)
                    r = run(label, "quant", d, ["--format", fmt, "--scale", rule])
                    if r is None:
                        continue
                    c, S, y = mx_ref(x, el, rule)
                    fin = np.repeat(S != 0xFF, 32, axis=1)
                    codes = unpack4(r["codes"], x.shape[1]) if el == "e2m1" else r["codes"]
                    check_equal(label, "codes", np.where(fin, codes, 0), np.where(fin, c, 0))
                    check_equal(label, "scales", r["scales"], S)
                    check_equal(label, "dequant", r["dequant"], y)
        if x.shape[1] % 16 == 0:
            label = f"quant {mname} nvfp4"
            d = ck.newdir()
            inputs(d, x=x)
            r = run(label, "quant", d, ["--format", "nvfp4"])
            if r is not None:
                c, S, y, g = nv_ref(x)
                fin = np.repeat(S != 0x7F, 16, axis=1)
                check_equal(label, "codes", np.where(fin, unpack4(r["codes"], x.shape[1]), 0), np.where(fin, c, 0))
                check_equal(label, "scales", r["scales"], S)
                check_equal(label, "dequant", r["dequant"], y)

# ---------------------------------------------------------------- sweep: route (exact update)
if ck.want("route"):
    for (m, n, k, kind) in ((1, 2, 1, "rand"), (7, 3, 2, "ties"), (33, 17, 16, "rand"), (100, 8, 1, "ties"), (64, 896, 16, "rand")):
        s = rng.uniform(0, 1, (m, n)).astype(f32)
        b = (rng.standard_normal(n) * 0.05).astype(f32)
        if kind == "ties":
            s, b = (rng.integers(0, 3, (m, n)) / 4).astype(f32), np.zeros(n, f32)
        label = f"route {(m, n, k, kind)}"
        d = ck.newdir()
        inputs(d, scores=s, bias=b)
        r = run(label, "route", d, ["--k", str(k), "--scale", "2.5", "--update", "exact", "--threads", "3"])
        if r is None:
            continue
        idx, w = route_ref(s, b, k, 2.5)
        check_equal(label, "indices", r["indices"], idx.astype(np.int32))
        check_rel(label, "weights", r["weights"], w, 1e-6)
        check_equal(label, "load", r["load"], np.bincount(idx.ravel(), minlength=n).astype(np.int64))
        z = (s + b[None]).astype(f32)
        cut = np.array([sorted(z[i].tolist(), reverse=True)[k] for i in range(m)], np.float64)
        bn = np.sort(cut[:, None] - s.astype(np.float64), axis=0)[(m * k) // n]
        check_rel(label, "new_bias", r["new_bias"], bn - bn.mean(), 1e-6)

ck.finish()
