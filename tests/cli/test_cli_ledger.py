"""End-to-end check of `k3 ledger`: the --json object's keys and the article's headline figures,
toggles moving their rows (none: the k3 column equals the naive one), the sliders, --plot
writing a PNG that decodes (signature, IHDR, chunk CRCs, zlib stream), and usage errors.
Usage: test_cli_ledger.py K3_BINARY WORKDIR"""
import json
import os
import struct
import subprocess
import sys
import zlib

k3, work = sys.argv[1], sys.argv[2]
os.makedirs(work, exist_ok=True)
fails = 0


def check(ok, what):
    global fails
    if not ok:
        fails += 1
        print("FAIL:", what)


def ledger(*extra):
    r = subprocess.run([k3, "ledger", "--json", *extra], capture_output=True, text=True)
    check(r.returncode == 0, f"{extra}: exit {r.returncode}: {r.stderr}")
    return json.loads(r.stdout) if r.returncode == 0 else None


rows = ["weights", "grads", "optimizer", "activations", "comm", "total"]
names = ["fp8_activations", "offload", "moe_backward_rewrite", "pp_balance", "zero2_cpu_grads", "p2p_muon", "moonep_buffers"]
j = ledger()
if j:
    check(set(j) == {"params", "activation_values_per_token", "per_gpu_bytes", "toggles"}, f"keys {sorted(j)}")
    check(set(j["params"]) == {"routed_experts", "kda", "mla", "moe_non_expert", "embedding", "dense_ffn", "non_expert", "total"}, "params keys")
    check(set(j["activation_values_per_token"]) == {"kda_layer", "mla_layer", "moe_layer", "model"}, "activation keys")
    for col in ("naive", "k3"):
        check(set(j["per_gpu_bytes"][col]) == set(rows), f"{col} keys")
        check(abs(sum(j["per_gpu_bytes"][col][r] for r in rows[:-1]) - j["per_gpu_bytes"][col]["total"]) < 1e3, f"{col} total")
    check(j["toggles"] == {n: True for n in names}, f"default toggles {j['toggles']}")
    check(abs(j["params"]["routed_experts"] / 2.72e12 - 1) < 0.005, "routed experts ~2.72T")
    check(abs(j["params"]["non_expert"] / 57e9 - 1) < 0.01, "non-expert ~57B")
    check(abs(j["activation_values_per_token"]["model"] / 29e6 - 1) < 0.01, "~29M values per token")
    ratio = j["per_gpu_bytes"]["naive"]["total"] / j["per_gpu_bytes"]["k3"]["total"]
    check(10 ** 0.5 <= ratio <= 10 ** 1.5, f"columns differ by {ratio:.1f}x, not an order of magnitude")

n = ledger("--toggles", "none")
if n:
    check(n["per_gpu_bytes"]["k3"] == n["per_gpu_bytes"]["naive"], "toggles none: k3 column differs from naive")
    check(not any(n["toggles"].values()), "toggles none reported on")
o = ledger("--toggles", "offload,p2p_muon")
if o and n:
    check(o["toggles"]["offload"] and o["toggles"]["p2p_muon"] and not o["toggles"]["fp8_activations"], "toggle list")
    check(o["per_gpu_bytes"]["k3"]["activations"] < n["per_gpu_bytes"]["k3"]["activations"], "offload moves activations")
    check(o["per_gpu_bytes"]["k3"]["weights"] == n["per_gpu_bytes"]["k3"]["weights"], "offload moved weights")
s = ledger("--pp", "4", "--vpp", "1", "--ep", "16", "--dp", "2", "--tokens", "4096", "--toggles", "none")
if s:
    p = s["params"]
    check(abs(s["per_gpu_bytes"]["naive"]["weights"] - (p["non_expert"] / 4 * 2 + p["routed_experts"] / 64 * 2)) < 1e3, "weights formula")
    check(abs(s["per_gpu_bytes"]["naive"]["activations"] - s["activation_values_per_token"]["model"] / 4 * 4096 * 2 * 4) < 1e3,
          "activations: stage x S x 2 B x (P - 0) in flight")

png = os.path.join(work, "ledger.png")
if os.path.exists(png):
    os.remove(png)
r = subprocess.run([k3, "ledger", "--plot", png], capture_output=True, text=True)
check(r.returncode == 0 and os.path.exists(png), f"--plot: exit {r.returncode}: {r.stderr}")
if os.path.exists(png):
    data = open(png, "rb").read()
    check(data[:8] == b"\x89PNG\r\n\x1a\n", "PNG signature")
    pos, idat, size = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        crc = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0]
        check(zlib.crc32(kind + body) == crc, f"chunk {kind} CRC")
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        if kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    check(size is not None and len(raw) == size[1] * (1 + 3 * size[0]), f"PNG pixels: {size}, {len(raw)} bytes")

for extra, text in [(["--toggles", "fp9"], "unknown technique 'fp9'"), (["--pp", "0"], "--pp"), (["--in", "x"], "unknown option")]:
    r = subprocess.run([k3, "ledger", *extra], capture_output=True, text=True)
    check(r.returncode == 2 and text in r.stderr, f"{extra}: exit {r.returncode}, {r.stderr!r}")

print("k3 ledger:", "FAILED" if fails else "passed", f"({fails} failures)")
sys.exit(1 if fails else 0)
