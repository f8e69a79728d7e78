#!/usr/bin/env python3
"""Cross-check `k3 kda` against an independent float64 numpy reference written from
shared/spec/kda.md section 1.1 and issue #3:
    S'_t = Diag(exp g_t) S_{t-1};  S_t = S'_t + beta_t k_t (v_t - S'_t^T k_t)^T;  o_t = S_t^T (scale q_t)
q/k head h serves value heads h*G..h*G+G-1 (G = HV/H); varlen via cu_seqlens (B = 1, state reset).
Gradients: complex-step derivatives of L = <do, o> + <dht, ht> (exact to rounding), elementwise on
tiny shapes and along random directions on larger ones."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Checker, compare, rel_rms, run_recurrence_case, same_outputs, save, write_raw_npy, zero_size_cases  # noqa: E402


def kda_ref(q, k, v, g, beta, scale, h0=None, cu=None):
    """Leading extra axes allowed (directions for the complex step): q [...,B,T,H,K]."""
    B, T, H, K = q.shape[-4:]
    HV, V = v.shape[-2:]
    G = HV // H
    qh = np.repeat(q, G, axis=-2)
    kh = np.repeat(k, G, axis=-2)
    lead = q.shape[:-4]
    dt = np.result_type(q, k, v, g, beta, h0 if h0 is not None else np.float64, np.float64)
    o = np.zeros(lead + (B, T, HV, V), dtype=dt)
    seqs = [(0, int(cu[i]), int(cu[i + 1])) for i in range(len(cu) - 1)] if cu is not None else [(b, 0, T) for b in range(B)]
    ht = np.zeros(lead + (len(seqs), HV, K, V), dtype=dt)
    for n, (b, s, e) in enumerate(seqs):
        S = np.array(h0[..., n, :, :, :], dtype=dt) if h0 is not None else np.zeros(lead + (HV, K, V), dtype=dt)
        for t in range(s, e):
            S = S * np.exp(g[..., b, t, :, :])[..., None]
            kt = kh[..., b, t, :, :]
            pred = np.einsum("...hk,...hkv->...hv", kt, S)
            u = beta[..., b, t, :][..., None] * (v[..., b, t, :, :] - pred)
            S = S + kt[..., :, None] * u[..., None, :]
            o[..., b, t, :, :] = np.einsum("...hk,...hkv->...hv", scale * qh[..., b, t, :, :], S)
        ht[..., n, :, :, :] = S
    return o, ht


NAMES = ["q", "k", "v", "g", "beta", "h0"]
GRADS = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "h0": "dh0"}


def make_case(rng, B, T, H, HV, K, V, dtype, cu=None, gate="normal", h0=True, beta_max=1.0):
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K))
    k /= np.sqrt((k ** 2).sum(-1, keepdims=True) + 1e-6)
    v = rng.standard_normal((B, T, HV, V))
    if gate == "normal":
        g = np.log(rng.uniform(0.3, 1.0, (B, T, HV, K)))
    elif gate == "lb5":
        g = rng.uniform(-5, 0, (B, T, HV, K))
        g[rng.random(g.shape) < 0.2] = -5.0
    elif gate == "reset":
        g = np.log(rng.uniform(0.3, 1.0, (B, T, HV, K)))
        g[:, rng.random(T) < 0.1] = -1000.0
    elif gate == "strong":
        g = -rng.exponential(2.0, (B, T, HV, K))
    beta = rng.uniform(0, beta_max, (B, T, HV))
    nseq = B if cu is None else len(cu) - 1
    hz = rng.standard_normal((nseq, HV, K, V)) if h0 else None
    c = lambda a: None if a is None else a.astype(dtype)
    return dict(q=c(q), k=c(k), v=c(v), g=c(g), beta=c(beta), h0=c(hz))


def random_cu(rng, T, nseq, allow_empty=True):
    cuts = np.sort(rng.integers(0, T + 1, nseq - 1)) if nseq > 1 else np.array([], dtype=int)
    cu = np.concatenate([[0], cuts, [T]]).astype(np.int64)
    return cu


def run_case(ck, label, rng, inp, cu=None, cu_dtype=np.int64, scale=None, mode="chunk", backward=True, lb=None,
             elementwise=False, tol_f=None, tol_b=None, dht_on=True):
    opts = ["--mode", mode]
    if lb is not None:
        opts += ["--gate-lower-bound", repr(lb)]
    ref = lambda x, sc: kda_ref(x["q"], x["k"], x["v"], x["g"], x["beta"], sc, x["h0"], cu)
    run_recurrence_case(ck, label, rng, inp, NAMES, GRADS, ref, opts, scale, cu, cu_dtype, backward, elementwise, tol_f,
                        tol_b, dht_on)


def bad_inputs(ck, rng):
    base = make_case(rng, 1, 5, 2, 4, 3, 2, np.float64)
    d0 = lambda: ck.newdir()

    def setup(mod=None, extra=None, drop=()):
        d = d0()
        x = dict(base)
        if mod:
            x.update(mod)
        for nm in NAMES:
            if nm in drop or x.get(nm) is None:
                continue
            save(d, nm, x[nm])
        for nm, a in (extra or {}).items():
            save(d, nm, a)
        return d

    f = base
    ck.expect_error("bad: q float16", setup({"q": f["q"].astype(np.float16)}), must_mention="q")
    ck.expect_error("bad: k dtype mismatch", setup({"k": f["k"].astype(np.float32)}), must_mention="k")
    ck.expect_error("bad: q int32", setup({"q": f["q"].astype(np.int32)}), must_mention="q")
    ck.expect_error("bad: q rank 3", setup({"q": f["q"][0]}), must_mention="q")
    ck.expect_error("bad: k shape", setup({"k": f["k"][:, :4]}), must_mention="k")
    ck.expect_error("bad: v T mismatch", setup({"v": f["v"][:, :4]}), must_mention="v")
    ck.expect_error("bad: HV not multiple of H", setup({"v": rng.standard_normal((1, 5, 3, 2)), "g": rng.standard_normal((1, 5, 3, 3)),
                                                         "beta": rng.random((1, 5, 3)), "h0": None}), must_mention=["HV", "v", "multiple"])
    ck.expect_error("bad: g shape", setup({"g": f["g"][..., :2]}), must_mention="g")
    ck.expect_error("bad: beta shape", setup({"beta": f["beta"][..., None]}), must_mention="beta")
    ck.expect_error("bad: h0 shape", setup({"h0": f["h0"][:, :2]}), must_mention="h0")
    ck.expect_error("bad: h0 dtype", setup({"h0": f["h0"].astype(np.float32)}), must_mention="h0")
    # an empty optional array is a wrong shape, not "absent" (was silently dropped)
    ck.expect_error("bad: h0 empty [0,HV,K,V]", setup({"h0": f["h0"][:0]}), must_mention="h0")
    ck.expect_error("bad: h0 empty [0]", setup({"h0": np.zeros(0)}), must_mention="h0")
    ck.expect_error("bad: h0 empty [0,0,0,0]", setup({"h0": np.zeros((0, 0, 0, 0))}), must_mention="h0")
    ck.expect_error("bad: dht empty", setup(extra={"do": rng.standard_normal((1, 5, 4, 2)), "dht": np.zeros((0, 4, 3, 2))}),
                    ["--backward"], must_mention="dht")
    ck.expect_error("bad: missing beta", setup(drop=("beta",)), must_mention="beta")
    for cu, lab in (([0, 3, 2, 5], "non-decreasing"), ([0, 2, 4], "not ending at T"), ([1, 3, 5], "not starting at 0"),
                    ([0, 3, 6], "beyond T"), ([], "empty"), ([0, -1, 5], "negative")):
        ck.expect_error(f"bad: cu_seqlens {lab}", setup({"h0": None}, {"cu_seqlens": np.array(cu, dtype=np.int64)}), must_mention="cu_seqlens")
    ck.expect_error("bad: cu_seqlens float", setup({"h0": None}, {"cu_seqlens": np.array([0., 5.])}), must_mention="cu_seqlens")
    ck.expect_error("bad: cu_seqlens 2-d", setup({"h0": None}, {"cu_seqlens": np.array([[0, 5]])}), must_mention="cu_seqlens")
    b2 = make_case(rng, 2, 5, 1, 1, 3, 2, np.float64, h0=False)
    d = ck.newdir()
    for nm in NAMES:
        if b2[nm] is not None:
            save(d, nm, b2[nm])
    save(d, "cu_seqlens", np.array([0, 5], dtype=np.int32))
    ck.expect_error("bad: cu_seqlens with B=2", d, must_mention=["cu_seqlens", "B"])
    ck.expect_error("bad: h0 N != number of sequences", setup(extra={"cu_seqlens": np.array([0, 2, 5], dtype=np.int32)}), must_mention="h0")
    # backward inputs
    ck.expect_error("bad: --backward without do", setup(), ["--backward"], must_mention="do")
    ck.expect_error("bad: do shape", setup(extra={"do": rng.standard_normal((1, 5, 4, 3))}), ["--backward"], must_mention="do")
    ck.expect_error("bad: dht shape", setup(extra={"do": rng.standard_normal((1, 5, 4, 2)), "dht": rng.standard_normal((2, 4, 3, 2))}),
                    ["--backward"], must_mention="dht")
    ck.expect_error("bad: do dtype", setup(extra={"do": rng.standard_normal((1, 5, 4, 2)).astype(np.float32)}), ["--backward"], must_mention="do")
    # options
    ck.expect_error("bad: --mode foo", setup(), ["--mode", "foo"], must_mention="mode")
    ck.expect_error("bad: --scale abc", setup(), ["--scale", "abc"], must_mention="scale")
    ck.expect_error("bad: --gate-lower-bound 1", setup(), ["--gate-lower-bound", "1"], must_mention="lower")
    ck.expect_error("bad: --gate-lower-bound -6", setup(), ["--gate-lower-bound", "-6"], must_mention="lower")
    # a gate below the promised bound must not give silent garbage: error, or the exact result
    d = setup({"g": np.full_like(f["g"], -20.0)})
    rc, text, cmd = ck.run(d, ["--gate-lower-bound", "-5"])
    if rc == 0:
        o_ref, _ = kda_ref(f["q"], f["k"], f["v"], np.full_like(f["g"], -20.0), f["beta"], 3 ** -0.5, f["h0"])
        compare(ck, "gate below promised bound", ck.out(d, "o"), o_ref, 1e-12, cmd, "o")
    elif rc not in (1, 2) or len(text.strip().splitlines()) != 1:
        ck.fail("gate below promised bound", f"exit {rc}: {text[:300]}", cmd)
    else:
        ck.ok("gate below promised bound: error")
    # malformed files
    d = setup()
    with open(os.path.join(d, "in", "q.npy"), "rb") as fh:
        raw = fh.read()
    with open(os.path.join(d, "in", "q.npy"), "wb") as fh:
        fh.write(raw[: len(raw) - 7])
    ck.expect_error("bad: truncated q.npy", d, must_mention="q")
    d = setup()
    with open(os.path.join(d, "in", "q.npy"), "wb") as fh:
        fh.write(b"this is not an npy file at all" * 3)
    ck.expect_error("bad: garbage q.npy", d, must_mention="q")
    d = setup()
    with open(os.path.join(d, "in", "k.npy"), "wb") as fh:
        fh.write(b"")
    ck.expect_error("bad: empty k.npy", d, must_mention="k")
    # numpy's other layouts hold the same numbers: read, not rejected
    d = setup()
    np.save(os.path.join(d, "in", "q.npy"), np.asfortranarray(f["q"]))
    same_outputs(ck, "Fortran-order q", setup(), d, ["o", "ht"])
    d = setup()
    np.save(os.path.join(d, "in", "v.npy"), f["v"].astype(">f8"))
    same_outputs(ck, "big-endian v", setup(), d, ["o", "ht"])
    d = setup()
    write_raw_npy(os.path.join(d, "in", "q.npy"), "{'descr': '<f8', 'fortran_order': False, 'shape': (1, 5, 2, 99999999999), }",
                  f["q"].tobytes())
    ck.expect_error("bad: huge shape q", d, must_mention="q")
    d = setup()
    write_raw_npy(os.path.join(d, "in", "q.npy"), "{'descr': '<f8', 'fortran_order': False, 'shape': (1, 5, 2, 3), }",
                  f["q"].tobytes() + b"\0" * 8)
    ck.expect_error("bad: trailing bytes q", d, must_mention="q")
    d = setup()
    np.save(os.path.join(d, "in", "q.npy"), np.array([1, 2], dtype=object), allow_pickle=True)
    ck.expect_error("bad: object dtype q", d, must_mention="q")
    d = setup()
    np.save(os.path.join(d, "in", "q.npy"), np.zeros(3, dtype=[("a", "<f8")]))
    ck.expect_error("bad: structured dtype q", d, must_mention="q")
    # non-finite confinement: NaN in one sequence and head stays there
    cu = np.array([0, 4, 4, 9, 16])
    x = make_case(rng, 1, 16, 2, 4, 5, 3, np.float64, cu=cu)
    x["v"][0, 5, 1, 0] = np.nan  # sequence 2 (tokens 4..8), value head 1 (q/k head 0)
    x["k"][0, 10, 1, 2] = np.inf  # sequence 3, q/k head 1 -> value heads 2, 3
    d = ck.newdir()
    for nm in NAMES:
        save(d, nm, x[nm])
    save(d, "cu_seqlens", cu)
    rc, text, cmd = ck.run(d, [])
    if rc != 0:
        ck.fail("nan confinement", f"exit {rc}: {text[:300]}", cmd)
    else:
        o_ref, ht_ref = kda_ref(x["q"], x["k"], x["v"], x["g"], x["beta"], 5 ** -0.5, x["h0"], cu)
        o, ht = ck.out(d, "o"), ck.out(d, "ht")
        # hard requirement (issue #3): non-finite values stay inside (sequence 2, value head 1) and
        # (sequence 3, value heads 2-3); everything else equals the reference
        allowed = np.zeros(o.shape, bool)
        allowed[0, 4:9, 1] = True
        allowed[0, 9:16, 2:4] = True
        leak = ~np.isfinite(o) & ~allowed
        if leak.any():
            ck.fail("nan confinement", f"o: non-finite outside the poisoned sequence/head at {np.argwhere(leak)[:5].tolist()}", cmd)
        fin = np.isfinite(o_ref) & ~allowed
        compare(ck, "nan confinement", np.where(fin, o, 0), np.where(fin, o_ref, 0), 1e-12, cmd, "o outside")
        # causality inside the poisoned sequence: tokens before the NaN/Inf do not depend on it
        pre = np.isfinite(o_ref) & allowed
        if (~np.isfinite(o[pre])).any():
            bad = np.argwhere(pre & ~np.isfinite(o))
            ck.warn("nan prefix causality", f"o: tokens BEFORE the non-finite input are non-finite at (b,t,hv) "
                    f"{sorted(set(map(tuple, bad[:, :3].tolist())))} (NaN at t=5 hv=1, Inf at t=10 hv=2,3)", cmd)
        else:
            compare(ck, "nan prefix causality", o[pre], o_ref[pre], 1e-12, cmd, "o before the NaN")
        compare(ck, "nan confinement", np.where(np.isfinite(ht_ref), ht, 0), np.where(np.isfinite(ht_ref), ht_ref, 0), 1e-12, cmd,
                "ht finite part")
        for mode in ("recurrent",):
            rc, text, cmd2 = ck.run(d, ["--mode", mode])
            o2 = ck.out(d, "o")
            if rc != 0 or (np.isfinite(o2) != np.isfinite(o_ref)).any():
                ck.fail("nan confinement recurrent", f"exit {rc} or non-finite pattern differs", cmd2)
            else:
                compare(ck, "nan confinement recurrent", np.nan_to_num(o2), np.nan_to_num(o_ref), 1e-12, cmd2, "o")


def prefix_invariance(ck, rng, lb, T=100, t0=70, gate="lb5", mode="chunk"):
    """Changing tokens >= t0 must not change o or the gradients of tokens < t0 (issue #3, fla #1240)."""
    label = f"prefix t0={t0} T={T} gate={gate} lb={lb} {mode}"
    x = make_case(rng, 1, T, 1, 2, 32, 16, np.float64, gate=gate)
    y = {kk: (None if vv is None else vv.copy()) for kk, vv in x.items()}
    for nm in ("q", "k", "v", "g", "beta"):
        fresh = make_case(rng, 1, T, 1, 2, 32, 16, np.float64, gate=gate)[nm]
        y[nm][:, t0:] = fresh[:, t0:]
    do = rng.standard_normal((1, T, 2, 16))
    do[:, t0:] = 0
    outs = []
    for inp in (x, y):
        d = ck.newdir()
        for nm in NAMES:
            save(d, nm, inp[nm])
        save(d, "do", do)
        opts = ["--backward", "--mode", mode] + (["--gate-lower-bound", repr(lb)] if lb is not None else [])
        rc, text, cmd = ck.run(d, opts)
        if rc != 0:
            ck.fail(label, f"exit {rc}: {text[:300]}", cmd)
            return
        outs.append((d, cmd))
    for nm in ("o", "dq", "dk", "dv", "dg", "dbeta"):
        a = ck.out(outs[0][0], nm)[:, :t0]
        b = ck.out(outs[1][0], nm)[:, :t0]
        diff = np.abs(a - b).max()
        if diff != 0:
            ck.fail(label, f"{nm}[:, :t0] changed by up to {diff:.3e} (rel {diff / np.abs(a).max():.1e}) when only tokens >= {t0} changed",
                    outs[1][1])
        else:
            ck.ok(label + " " + nm)
    a, b = ck.out(outs[0][0], "dh0"), ck.out(outs[1][0], "dh0")
    if np.abs(a - b).max() != 0:
        ck.fail(label, f"dh0 changed by up to {np.abs(a - b).max():.3e}", outs[1][1])
    for nm in ("dq", "dk", "dv", "dg", "dbeta"):
        tail = ck.out(outs[1][0], nm)[:, t0:]
        if np.abs(tail).max() != 0:
            ck.fail(label, f"{nm}[:, t0:] should be exactly 0 (do = 0 there, no dht), max {np.abs(tail).max():.3e}", outs[1][1])


def long_float32(ck, rng, T=8192):
    """Issue #3: float32 against a float64 reference at T = 8192, rel-RMS <= 1e-5 for o and ht."""
    x = make_case(rng, 1, T, 1, 1, 128, 128, np.float32)
    run_case(ck, f"f32 long T={T}", rng, x, backward=False, tol_f=1e-5)

def hard_resets(ck):
    """A hard reset is a very negative log-decay; exp(-inf) = 0 is the exact limit. The chunked form
    must agree with the serial one (and the reference) for any such value, in float64 at 1e-12."""
    for val in (-1e3, -1e5, -np.inf):
        for mode in ("chunk", "recurrent"):
            rng = np.random.default_rng(0)
            x = make_case(rng, 1, 200, 1, 1, 16, 8, np.float64)
            x["g"][:, [10, 70, 71, 150]] = val
            lab = f"hard reset g={val} {mode}"
            if val == -1e5:
                # relative error grows like |g| * eps in the chunked form (cumsum inside a chunk)
                d = ck.newdir()
                run_case(ck, lab, rng, x, mode=mode, backward=False, tol_f=1e-10)
            else:
                run_case(ck, lab, rng, x, mode=mode, backward=True)
    # float32: the hard-reset value -1000 against the float32 target 1e-5
    rng = np.random.default_rng(0)
    x = make_case(rng, 1, 200, 1, 1, 16, 8, np.float32)
    x["g"][:, [10, 70, 71, 150]] = -1000.0
    d = ck.newdir()
    for nm in NAMES:
        save(d, nm, x[nm])
    rc, text, cmd = ck.run(d, ["--mode", "chunk"])
    f64 = {n: x[n].astype(np.float64) for n in NAMES}
    o_ref, _ = kda_ref(f64["q"], f64["k"], f64["v"], f64["g"], f64["beta"], 0.25, f64["h0"])
    e = rel_rms(ck.out(d, "o"), o_ref)
    if not e <= 1e-5:
        ck.warn("f32 hard reset g=-1000 chunk", f"o rel-RMS {e:.2e} > 1e-5 (recurrent mode: ~1e-7); the chunk-local cumsum carries the "
                f"reset's magnitude, so every factor after it loses |g|*eps32", cmd)
    else:
        ck.ok("f32 hard reset")


def main():
    ck = Checker("kda")
    for seed in range(ck.args.seeds):
        rng = np.random.default_rng(1000 + seed)
        # tiny shapes: elementwise complex-step gradients, both modes
        for mode in ("chunk", "recurrent"):
            for (B, T, H, HV, K, V) in [(1, 1, 1, 1, 1, 1), (2, 3, 1, 2, 3, 2), (1, 7, 2, 4, 2, 3), (1, 17, 1, 1, 3, 1)]:
                lab = f"tiny s{seed} {mode} B{B} T{T} H{H} HV{HV} K{K} V{V}"
                if ck.want(lab):
                    run_case(ck, lab, rng, make_case(rng, B, T, H, HV, K, V, np.float64), mode=mode, elementwise=True)
        # awkward shapes, float64, directional gradient checks
        shapes = [(1, 1, 2, 4, 16, 16), (2, 15, 1, 2, 60, 100), (1, 63, 2, 2, 17, 3), (1, 64, 1, 2, 128, 16),
                  (1, 65, 1, 1, 100, 60), (1, 200, 1, 2, 16, 128), (2, 130, 2, 4, 3, 17), (1, 129, 1, 1, 129, 1),
                  (1, 70, 1, 1, 1, 129)]
        for i, (B, T, H, HV, K, V) in enumerate(shapes):
            gate = ["normal", "reset", "strong"][(i + seed) % 3]
            lab = f"f64 s{seed} B{B} T{T} H{H} HV{HV} K{K} V{V} gate={gate}"
            if ck.want(lab):
                run_case(ck, lab, rng, make_case(rng, B, T, H, HV, K, V, np.float64, gate=gate, beta_max=2.0 if i % 2 else 1.0),
                         scale=0.37 if i == 3 else None, dht_on=(i % 4 != 1))
        # lower-bounded gate at exactly -5 with the dense diagonal-tile promise
        for T in (64, 100):
            lab = f"lb-5 s{seed} T{T}"
            if ck.want(lab):
                run_case(ck, lab, rng, make_case(rng, 1, T, 1, 2, 32, 20, np.float64, gate="lb5"), lb=-5.0)
        # varlen: empty and very short sequences, int32 and int64 offsets
        for cu_dtype in (np.int32, np.int64):
            for cu in ([0, 0, 1, 1, 17, 80, 80, 143], [0, 64, 64, 129, 130], [0, 5], [0, 0], [0, 0, 0]):
                cu = np.array(cu)
                T = int(cu[-1])
                lab = f"varlen s{seed} {np.dtype(cu_dtype).name} cu={cu.tolist()}"
                if ck.want(lab):
                    run_case(ck, lab, rng, make_case(rng, 1, T, 1, 2, 20, 7, np.float64, cu=cu, gate="normal"), cu=cu, cu_dtype=cu_dtype)
            cu = random_cu(rng, 150, 6)
            lab = f"varlen-rand s{seed} {np.dtype(cu_dtype).name} cu={cu.tolist()}"
            if ck.want(lab):
                run_case(ck, lab, rng, make_case(rng, 1, 150, 2, 4, 9, 11, np.float64, cu=cu, gate="reset"), cu=cu, cu_dtype=cu_dtype,
                         mode="recurrent" if seed % 2 else "chunk")
        # varlen tiny with elementwise gradients (h0 gradients pass through empty sequences)
        cu = np.array([0, 2, 2, 5])
        lab = f"varlen-tiny s{seed}"
        if ck.want(lab):
            run_case(ck, lab, rng, make_case(rng, 1, 5, 1, 2, 2, 3, np.float64, cu=cu), cu=cu, elementwise=True)
        # no h0 given
        lab = f"no-h0 s{seed}"
        if ck.want(lab):
            run_case(ck, lab, rng, make_case(rng, 1, 40, 1, 1, 8, 8, np.float64, h0=False))
        # float32
        for (B, T, H, HV, K, V) in [(1, 1, 1, 1, 16, 16), (1, 300, 2, 4, 64, 64), (2, 77, 1, 2, 60, 100), (1, 128, 1, 1, 128, 128)]:
            for mode in ("chunk", "recurrent"):
                lab = f"f32 s{seed} {mode} B{B} T{T} H{H} HV{HV} K{K} V{V}"
                if ck.want(lab):
                    run_case(ck, lab, rng, make_case(rng, B, T, H, HV, K, V, np.float32), mode=mode)
        lab = f"f32 varlen s{seed}"
        if ck.want(lab):
            cu = np.array([0, 3, 3, 70, 200])
            run_case(ck, lab, rng, make_case(rng, 1, 200, 1, 2, 32, 32, np.float32, cu=cu, gate="lb5"), cu=cu, lb=-5.0)
    if ck.want("prefix"):
        rng = np.random.default_rng(77)
        for (lb, gate, T, t0) in ((-5.0, "lb5", 100, 70), (-5.0, "lb5", 100, 97), (None, "normal", 100, 70), (None, "strong", 150, 130),
                                  (-5.0, "lb5", 64, 1), (None, "reset", 90, 33)):
            prefix_invariance(ck, rng, lb, T, t0, gate)
        prefix_invariance(ck, rng, None, 100, 70, "normal", mode="recurrent")
    if ck.want("long"):
        long_float32(ck, np.random.default_rng(78))
    if ck.want("hard reset"):
        hard_resets(ck)
    if ck.want("bad"):
        bad_inputs(ck, np.random.default_rng(7))
    if ck.want("zero"):
        zero_size_cases(ck, lambda B, T: make_case(np.random.default_rng(3), B, T, 1, 1, 4, 3, np.float64), NAMES)
    ck.finish()


if __name__ == "__main__":
    main()
