#!/usr/bin/env python3
"""Cross-check `k3 dplr` against an independent float64 numpy reference written from
shared/spec/kda.md section 4.1 (fla convention, [K, V] state) and issue #4:
    S_t = Diag(exp gk_t) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T,   o_t = S_t^T (scale q_t)
Gradients by complex step of L = <do, o> + <dht, ht>."""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Checker, compare, run_recurrence_case, same_outputs, save, zero_size_cases  # noqa: E402

NAMES = ["q", "k", "v", "a", "b", "gk", "h0"]
GRADS = {"q": "dq", "k": "dk", "v": "dv", "a": "da", "b": "db", "gk": "dgk", "h0": "dh0"}


def dplr_ref(q, k, v, a, b, gk, scale, h0=None, cu=None):
    B, T, H, K = q.shape[-4:]
    V = v.shape[-1]
    lead = q.shape[:-4]
    dt = np.result_type(q, k, v, a, b, gk, h0 if h0 is not None else np.float64, np.float64)
    o = np.zeros(lead + (B, T, H, V), dtype=dt)
    seqs = [(0, int(cu[i]), int(cu[i + 1])) for i in range(len(cu) - 1)] if cu is not None else [(bb, 0, T) for bb in range(B)]
    ht = np.zeros(lead + (len(seqs), H, K, V), dtype=dt)
    for n, (bb, s, e) in enumerate(seqs):
        S = np.array(h0[..., n, :, :, :], dtype=dt) if h0 is not None else np.zeros(lead + (H, K, V), dtype=dt)
        for t in range(s, e):
            aS = np.einsum("...hk,...hkv->...hv", a[..., bb, t, :, :], S)
            S = (S * np.exp(gk[..., bb, t, :, :])[..., None] + b[..., bb, t, :, :][..., :, None] * aS[..., None, :]
                 + k[..., bb, t, :, :][..., :, None] * v[..., bb, t, :, :][..., None, :])
            o[..., bb, t, :, :] = np.einsum("...hk,...hkv->...hv", scale * q[..., bb, t, :, :], S)
        ht[..., n, :, :, :] = S
    return o, ht


def make_case(rng, B, T, H, K, V, dtype, cu=None, gate="normal", h0=True, ab="rwkv"):
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K)) / np.sqrt(K)
    v = rng.standard_normal((B, T, H, V))
    a = rng.standard_normal((B, T, H, K))
    a /= np.sqrt((a ** 2).sum(-1, keepdims=True))
    if ab == "rwkv":
        b = -a * rng.uniform(0, 1, (B, T, H, 1))
    else:  # independent small b, IPLR-like
        b = 0.3 * rng.standard_normal((B, T, H, K)) / np.sqrt(K)
    if gate == "normal":
        gk = np.log(rng.uniform(0.5, 1.0, (B, T, H, K)))
    elif gate == "zero":
        gk = np.zeros((B, T, H, K))
    elif gate == "strong":
        gk = -rng.exponential(3.0, (B, T, H, K))
    elif gate == "reset":
        gk = np.log(rng.uniform(0.5, 1.0, (B, T, H, K)))
        gk[:, rng.random(T) < 0.1] = -1000.0
    nseq = B if cu is None else len(cu) - 1
    hz = rng.standard_normal((nseq, H, K, V)) if h0 else None
    c = lambda x: None if x is None else x.astype(dtype)
    return dict(q=c(q), k=c(k), v=c(v), a=c(a), b=c(b), gk=c(gk), h0=c(hz))


def run_case(ck, label, rng, inp, cu=None, cu_dtype=np.int64, scale=None, mode="chunk", backward=True, elementwise=False,
             chunk=None, threads=None, longseq=None, tol_f=None, tol_b=None, dht_on=True):
    opts = ["--mode", mode]
    if chunk is not None:
        opts += ["--chunk-size", str(chunk)]
    if threads is not None:
        opts += ["--threads", str(threads)]
    if longseq is not None:
        opts += ["--long-sequence", longseq]
    ref = lambda x, sc: dplr_ref(*(x[n] for n in ["q", "k", "v", "a", "b", "gk"]), sc, x["h0"], cu)
    run_recurrence_case(ck, label, rng, inp, NAMES, GRADS, ref, opts, scale, cu, cu_dtype, backward, elementwise, tol_f,
                        tol_b, dht_on)


def bad_inputs(ck, rng):
    base = make_case(rng, 1, 5, 2, 3, 2, np.float64)

    def setup(mod=None, extra=None, drop=()):
        d = ck.newdir()
        x = dict(base)
        x.update(mod or {})
        for nm in NAMES:
            if nm not in drop and x.get(nm) is not None:
                save(d, nm, x[nm])
        for nm, arr in (extra or {}).items():
            save(d, nm, arr)
        return d

    f = base
    ck.expect_error("bad: q float16", setup({"q": f["q"].astype(np.float16)}), must_mention="q")
    ck.expect_error("bad: a dtype mismatch", setup({"a": f["a"].astype(np.float32)}), must_mention="a")
    ck.expect_error("bad: q rank 3", setup({"q": f["q"][0]}), must_mention="q")
    ck.expect_error("bad: b shape", setup({"b": f["b"][..., :2]}), must_mention="'b'")
    ck.expect_error("bad: gk shape", setup({"gk": f["gk"][:, :4]}), must_mention="gk")
    ck.expect_error("bad: v heads", setup({"v": np.zeros((1, 5, 3, 2))}), must_mention="v")
    ck.expect_error("bad: h0 shape", setup({"h0": f["h0"][:, :1]}), must_mention="h0")
    ck.expect_error("bad: h0 dtype", setup({"h0": f["h0"].astype(np.float32)}), must_mention="h0")
    # an empty optional array is a wrong shape, not "absent" (was silently dropped)
    ck.expect_error("bad: h0 empty [0,H,K,V]", setup({"h0": f["h0"][:0]}), must_mention="h0")
    ck.expect_error("bad: h0 empty [0]", setup({"h0": np.zeros(0)}), must_mention="h0")
    ck.expect_error("bad: h0 empty [0,0,0,0]", setup({"h0": np.zeros((0, 0, 0, 0))}), must_mention="h0")
    ck.expect_error("bad: dht empty", setup(extra={"do": np.zeros((1, 5, 2, 2)), "dht": np.zeros((0, 2, 3, 2))}), ["--backward"],
                    must_mention="dht")
    ck.expect_error("bad: missing gk", setup(drop=("gk",)), must_mention="gk")
    for cu, lab in (([0, 3, 2, 5], "non-decreasing"), ([0, 2, 4], "not ending at T"), ([1, 3, 5], "not starting at 0"),
                    ([], "empty"), ([0, 6], "beyond T")):
        ck.expect_error(f"bad: cu_seqlens {lab}", setup({"h0": None}, {"cu_seqlens": np.array(cu, dtype=np.int64)}), must_mention="cu_seqlens")
    ck.expect_error("bad: cu_seqlens float", setup({"h0": None}, {"cu_seqlens": np.array([0., 5.])}), must_mention="cu_seqlens")
    ck.expect_error("bad: cu_seqlens 2-d", setup({"h0": None}, {"cu_seqlens": np.array([[0, 5]], dtype=np.int64)}), must_mention="cu_seqlens")
    ck.expect_error("bad: h0 N != sequences", setup(extra={"cu_seqlens": np.array([0, 2, 5], dtype=np.int32)}), must_mention="h0")
    ck.expect_error("bad: --backward without do", setup(), ["--backward"], must_mention="do")
    ck.expect_error("bad: do shape", setup(extra={"do": np.zeros((1, 5, 2, 3))}), ["--backward"], must_mention="do")
    ck.expect_error("bad: dht shape", setup(extra={"do": np.zeros((1, 5, 2, 2)), "dht": np.zeros((1, 2, 2, 2))}), ["--backward"], must_mention="dht")
    ck.expect_error("bad: --mode foo", setup(), ["--mode", "foo"], must_mention="mode")
    ck.expect_error("bad: --chunk-size 0", setup(), ["--chunk-size", "0"], must_mention="chunk")
    ck.expect_error("bad: --chunk-size -16", setup(), ["--chunk-size", "-16"], must_mention="chunk")
    ck.expect_error("bad: --threads -1", setup(), ["--threads", "-1"], must_mention="threads")
    # NOT run: --threads 100000 (or 100000000000, which wraps to 1215752192 in the int cast) makes the
    # thread pool try to start that many threads; it never finishes and exhausts the machine's
    # process limit for everyone (seen: "fork: Resource temporarily unavailable"). Reported instead.
    d = setup()
    with open(os.path.join(d, "in", "a.npy"), "wb") as fh:
        fh.write(b"\x93NUMPY\x01\x00garbage")
    ck.expect_error("bad: garbage a.npy", d, must_mention="a")
    d = setup()  # numpy's other layouts hold the same numbers: read, not rejected
    np.save(os.path.join(d, "in", "k.npy"), np.asfortranarray(f["k"]))
    same_outputs(ck, "Fortran k", setup(), d, ["o", "ht"])
    d = setup()
    np.save(os.path.join(d, "in", "gk.npy"), f["gk"].astype(">f8"))
    same_outputs(ck, "big-endian gk", setup(), d, ["o", "ht"])

def hard_resets(ck):
    """A hard reset is a very negative log-decay; exp(-inf) = 0 is the exact limit. The chunked form
    must agree with the serial one (and the reference) for any such value, in float64 at 1e-12."""
    for val in (-1e3, -1e5, -np.inf):
        for mode in ("chunk", "recurrent", "chunked"):
            rng = np.random.default_rng(0)
            x = make_case(rng, 1, 200, 1, 16, 8, np.float64)
            x["gk"][:, [10, 70, 71, 150]] = val
            lab = f"hard reset gk={val} {mode}"
            if val == -1e5:
                # relative error grows like |g| * eps in the chunked form (cumsum inside a chunk)
                d = ck.newdir()
                run_case(ck, lab, rng, x, mode=mode, backward=False, tol_f=1e-10)
            else:
                run_case(ck, lab, rng, x, mode=mode, backward=True)


def nan_confinement(ck, rng):
    """A NaN/Inf in one input of token t (sequence n, head h) must leave every other sequence and
    head exactly as the reference has them, with threads and both long-sequence strategies; tokens
    of (n, h) before t should stay finite too (reported as WARN: the chunked form's within-chunk
    products can carry it back inside t's chunk)."""
    cu = np.array([0, 4, 4, 9, 80, 150])
    for dt in (np.float64, np.float32):
        for i, nm in enumerate(("q", "k", "v", "a", "b", "gk")):
            val = [np.nan, np.inf, -np.inf][i % 3]
            opts = [[], ["--threads", "2"], ["--threads", "2", "--long-sequence", "segment-maps"], ["--mode", "recurrent"],
                    ["--chunk-size", "16", "--threads", "7"]][i % 5]
            lab = f"nan {np.dtype(dt).name} {nm}={val} {' '.join(opts)}"
            if not ck.want(lab):
                continue
            x = make_case(rng, 1, 150, 2, 5, 3, np.float64, cu=cu)
            x = {k: (None if v is None else v.astype(dt)) for k, v in x.items()}
            x[nm][0, 20, 1, 0] = val  # sequence 3 (tokens 9..79), head 1
            d = ck.newdir()
            for n in NAMES:
                save(d, n, x[n])
            save(d, "cu_seqlens", cu)
            rc, text, cmd = ck.run(d, opts)
            if rc != 0:
                ck.fail(lab, f"exit {rc}: {text[:300]}", cmd)
                continue
            o, ht = ck.out(d, "o"), ck.out(d, "ht")
            f64 = {k: v.astype(np.float64) for k, v in x.items()}
            with np.errstate(all="ignore"):
                o_ref, ht_ref = dplr_ref(*(f64[n] for n in ["q", "k", "v", "a", "b", "gk"]), 5 ** -0.5, f64["h0"], cu)
            inside = np.zeros(o.shape, bool)
            inside[0, 9:80, 1] = True
            leak = ~np.isfinite(o) & ~inside
            if leak.any():
                ck.fail(lab, f"o: non-finite outside the poisoned sequence/head at {np.argwhere(leak)[:4].tolist()}", cmd)
                continue
            tol = 1e-12 if dt == np.float64 else 2e-5
            compare(ck, lab, o[~inside], o_ref[~inside], tol, cmd, "o outside")
            hin = np.zeros(ht.shape, bool)
            hin[3, 1] = True
            compare(ck, lab, ht[~hin], ht_ref[~hin], tol, cmd, "ht outside")
            before = np.zeros(o.shape, bool)
            before[0, 9:20, 1] = True
            if not np.isfinite(o[before]).all():
                ck.warn(lab, "tokens of the poisoned sequence/head BEFORE the non-finite input are non-finite "
                        "(chunked form; the recurrent form keeps them)", cmd)
            else:
                compare(ck, lab, o[before], o_ref[before], tol, cmd, "o before")


def main():
    ck = Checker("dplr")
    for seed in range(ck.args.seeds):
        rng = np.random.default_rng(2000 + seed)
        for mode in ("chunk", "recurrent", "chunked"):
            for (B, T, H, K, V) in [(1, 1, 1, 1, 1), (2, 3, 1, 3, 2), (1, 9, 2, 2, 3), (1, 18, 1, 3, 1)]:
                lab = f"tiny s{seed} {mode} B{B} T{T} H{H} K{K} V{V}"
                if ck.want(lab):
                    run_case(ck, lab, rng, make_case(rng, B, T, H, K, V, np.float64, ab=["rwkv", "free"][T % 2]), mode=mode,
                             elementwise=True, chunk=[None, 4, 16][seed % 3])
        shapes = [(1, 15, 2, 16, 16), (2, 63, 1, 60, 3), (1, 64, 1, 17, 100), (1, 65, 2, 100, 17), (1, 200, 1, 3, 128),
                  (1, 129, 1, 129, 1), (1, 100, 1, 1, 60)]
        for i, (B, T, H, K, V) in enumerate(shapes):
            gate = ["normal", "zero", "reset", "strong"][(i + seed) % 4]
            chunk = [None, 16, 32, 64, 8, 1][(i + seed) % 6]
            lab = f"f64 s{seed} B{B} T{T} H{H} K{K} V{V} gate={gate} chunk={chunk}"
            if ck.want(lab):
                run_case(ck, lab, rng, make_case(rng, B, T, H, K, V, np.float64, gate=gate, ab=["rwkv", "free"][i % 2]), chunk=chunk,
                         threads=[1, 2, 0][i % 3], scale=0.5 if i == 2 else None, dht_on=(i % 3 != 1))
        # one long sequence through both long-sequence strategies
        for ls in ("value-split", "segment-maps"):
            lab = f"longseq s{seed} {ls}"
            if ck.want(lab):
                run_case(ck, lab, rng, make_case(rng, 1, 300, 1, 16, 24, np.float64, gate="normal"), threads=2, longseq=ls)
        for cu_dtype in (np.int32, np.int64):
            for cu in ([0, 0, 1, 1, 17, 80, 80, 143], [0, 64, 64, 129, 130], [0, 0]):
                cu = np.array(cu)
                lab = f"varlen s{seed} {np.dtype(cu_dtype).name} cu={cu.tolist()}"
                if ck.want(lab):
                    run_case(ck, lab, rng, make_case(rng, 1, int(cu[-1]), 2, 12, 7, np.float64, cu=cu), cu=cu, cu_dtype=cu_dtype,
                             threads=2, chunk=16)
            cu = np.concatenate([[0], np.sort(rng.integers(0, 150, 5)), [150]])
            lab = f"varlen-rand s{seed} {np.dtype(cu_dtype).name} cu={cu.tolist()}"
            if ck.want(lab):
                run_case(ck, lab, rng, make_case(rng, 1, 150, 1, 9, 11, np.float64, cu=cu, gate="reset"), cu=cu, cu_dtype=cu_dtype,
                         longseq="segment-maps", threads=2)
        cu = np.array([0, 2, 2, 5])
        lab = f"varlen-tiny s{seed}"
        if ck.want(lab):
            run_case(ck, lab, rng, make_case(rng, 1, 5, 1, 2, 3, np.float64, cu=cu), cu=cu, elementwise=True, chunk=2)
        lab = f"no-h0 s{seed}"
        if ck.want(lab):
            run_case(ck, lab, rng, make_case(rng, 1, 40, 1, 8, 8, np.float64, h0=False))
        for (B, T, H, K, V) in [(1, 1, 1, 16, 16), (1, 300, 2, 64, 64), (2, 77, 1, 60, 100)]:
            for mode in ("chunk", "recurrent", "chunked"):
                lab = f"f32 s{seed} {mode} B{B} T{T} H{H} K{K} V{V}"
                if ck.want(lab):
                    run_case(ck, lab, rng, make_case(rng, B, T, H, K, V, np.float32), mode=mode, threads=2)
    nan_confinement(ck, np.random.default_rng(2100))
    if ck.want("hard reset"):
        hard_resets(ck)
    if ck.want("bad"):
        bad_inputs(ck, np.random.default_rng(8))
    if ck.want("zero"):
        zero_size_cases(ck, lambda B, T: make_case(np.random.default_rng(3), B, T, 1, 4, 3, np.float64), NAMES)
    ck.finish()


if __name__ == "__main__":
    main()
