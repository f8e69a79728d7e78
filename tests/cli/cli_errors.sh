#!/usr/bin/env bash
# The k3 tool's framework: help and version work; bad invocations give one clear line on
# stderr and a non-zero exit, never a crash. Usage: cli_errors.sh /path/to/k3
set -u
k3=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
expect() {  # expect <exit code | nz (non-zero, not a signal)> <substring> -- args...
  local want=$1 needle=$2; shift 3
  "$k3" "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  local ok=1
  if [ "$want" = nz ]; then [ "$rc" != 0 ] && [ "$rc" -lt 128 ] || ok=0; else [ "$rc" = "$want" ] || ok=0; fi
  if [ $ok = 0 ] || ! grep -qF -- "$needle" "$tmp/err" "$tmp/out"; then
    echo "FAIL: k3 $* -> rc=$rc (want $want), output:"; cat "$tmp/out" "$tmp/err"; fail=1
  elif [ "$rc" != 0 ] && [ "$(wc -l <"$tmp/err")" -gt 1 ]; then
    echo "FAIL: k3 $* printed more than one line on stderr:"; cat "$tmp/err"; fail=1
  fi
}
expect 0 "usage: k3" -- --help
expect 0 "simd isa" -- version
expect 0 "simd isa" -- --version
expect 2 "unexpected argument 'extra'" -- version extra
: >"$tmp/afile"
expect 2 "unknown op 'frobnicate'" -- frobnicate
expect 2 "unknown op 'frobnicate'" -- help frobnicate
expect 2 "usage: k3" --
ops=$("$k3" --help | awk '/^ops:/{f=1;next} f{print $1}')
for op in $ops; do
  [ "$op" = version ] && continue
  expect 0 "usage: k3 $op" -- "$op" --help
  expect 0 "usage: k3 $op" -- help "$op"
  expect 0 "usage: k3 $op" -- --help "$op"
  expect 2 "unknown option '--bogus'" -- "$op" --bogus 1
  expect 2 "unexpected argument 'stray'" -- "$op" stray
  expect 2 "unexpected argument '-x'" -- "$op" -x
  # ops that read no files (k3 ledger) take no --in/--out
  if ! "$k3" "$op" --help | head -1 | grep -qF -- "--in DIR"; then
    expect 2 "unknown option '--in'" -- "$op" --in "$tmp" --out "$tmp/o"
    continue
  fi
  expect 2 "missing --in" -- "$op" --out "$tmp/o"
  expect 2 "is not a directory" -- "$op" --in "$tmp/nope" --out "$tmp/o"
  expect 2 "is not a directory" -- "$op" --in "$tmp/afile" --out "$tmp/o"
  expect 2 "--out '$tmp/afile' exists and is not a directory" -- "$op" --in "$tmp" --out "$tmp/afile"
  expect 2 "unknown option '--bogus'" -- "$op" --bogus 1
  expect 2 "unknown option '--bogus'" -- "$op" --bogus=1
  expect 2 "unexpected argument 'stray'" -- "$op" stray
  expect 2 "unexpected argument '-x'" -- "$op" -x
  expect 2 "option '--in' given more than once" -- "$op" --in "$tmp" --in "$tmp" --out "$tmp/o"
  expect 2 "option '--out' needs a value" -- "$op" --in "$tmp" --out
  expect 2 "option '--in' needs a value" -- "$op" --in
  expect 2 "option '--help' takes no value" -- "$op" --in "$tmp" --out "$tmp/o" --help=1 --bogus
  # options an op requires before it reads anything
  case $op in quant|dequant) req=(--format e4m3) ;; *) req=() ;; esac
  mkdir -p "$tmp/empty"
  expect nz "missing input" -- "$op" --in "$tmp/empty" --out "$tmp/o" "${req[@]}"
  # a malformed .npy for every input name the op could read
  mkdir -p "$tmp/bad"
  for n in q k v g beta a b gk sources w gain scores logits bias x codes scales; do printf 'garbage' >"$tmp/bad/$n.npy"; done
  expect nz "malformed .npy" -- "$op" --in "$tmp/bad" --out "$tmp/o" "${req[@]}"
done
# Options checked before anything is allocated or started (valid inputs otherwise).
if python3 -c "import numpy" 2>/dev/null; then
  mkdir -p "$tmp/r" "$tmp/d" "$tmp/a"
  python3 - "$tmp" <<'PY'
import sys, numpy as np
t = sys.argv[1]; rng = np.random.default_rng(0)
np.save(t + "/r/scores.npy", rng.random((8, 16), dtype=np.float32))
for n in "q k a b".split(): np.save(f"{t}/d/{n}.npy", rng.standard_normal((1, 5, 1, 3)))
np.save(t + "/d/v.npy", rng.standard_normal((1, 5, 1, 2)))
np.save(t + "/d/gk.npy", -rng.random((1, 5, 1, 3)))
np.save(t + "/d/cu_seqlens.npy", np.zeros(0, np.int64))
np.save(t + "/a/sources.npy", rng.standard_normal((2, 3, 4)).astype(np.float32))
np.save(t + "/a/w.npy", np.ones(4, np.float32)); np.save(t + "/a/gain.npy", np.ones(4, np.float32))
PY
  expect 2 "option '--k': must be in [1, n - 1] = [1, 15]" -- route --in "$tmp/r" --out "$tmp/o" --k -1
  expect 2 "option '--k': must be in [1, n - 1]" -- route --in "$tmp/r" --out "$tmp/o" --k 1099511627776
  expect 2 "option '--threads' must be in [0, 1024], got 100000" -- route --in "$tmp/r" --out "$tmp/o" --k 4 --threads 100000
  expect 2 "option '--threads' must be in [0, 1024], got -3" -- attnres --in "$tmp/r" --out "$tmp/o" --threads -3
  expect 2 "option '--threads' must be in [0, 1024]" -- dplr --in "$tmp/d" --out "$tmp/o" --threads 3000000000
  expect 2 "option '--bins' must be in [1, 1048576], got 0" -- route --in "$tmp/r" --out "$tmp/o" --k 4 --bins 0
  expect nz "argument 'cu_seqlens': needs at least one offset" -- dplr --in "$tmp/d" --out "$tmp/o"
  # repeated options are refused, whether or not the values agree
  expect 2 "option '--k' given more than once" -- route --in "$tmp/r" --out "$tmp/o" --k 4 --k 4
  expect 2 "option '--update' given more than once" -- route --in "$tmp/r" --out "$tmp/o" --k 4 --update exact --update=histogram
  expect 2 "option '--solve' given more than once" -- route --in "$tmp/r" --out "$tmp/o" --k 4 --solve --solve
  expect 2 "option '--mode' given more than once" -- dplr --in "$tmp/d" --out "$tmp/o" --mode chunked --mode recurrent
  # absurd or malformed option values: one clear line, before any work
  expect 2 "option '--iterations' must be in [1, 10000], got 100000000000" -- route --in "$tmp/r" --out "$tmp/o" --k 4 --solve --iterations 100000000000
  expect 2 "option '--k' expects an integer, got '4.5'" -- route --in "$tmp/r" --out "$tmp/o" --k 4.5
  expect 2 "option '--k' expects an integer, got '99999999999999999999'" -- route --in "$tmp/r" --out "$tmp/o" --k 99999999999999999999
  expect 2 "option '--threads' expects an integer, got ''" -- route --in "$tmp/r" --out "$tmp/o" --k 4 --threads=
  expect 2 "option '--scale' expects a number, got '1e999'" -- route --in "$tmp/r" --out "$tmp/o" --k 4 --scale 1e999
  expect 2 "option '--scale': must be finite, got nan" -- route --in "$tmp/r" --out "$tmp/o" --k 4 --scale nan
  expect 2 "option '--update' must be one of histogram|exact, got 'Exact'" -- route --in "$tmp/r" --out "$tmp/o" --k 4 --update Exact
  expect 2 "option '--chunk-size' expects an integer, got '0x10'" -- dplr --in "$tmp/d" --out "$tmp/o" --chunk-size 0x10
  expect 2 "option '--long-sequence' must be one of" -- dplr --in "$tmp/d" --out "$tmp/o" --long-sequence both
  expect 2 "option '--eps' expects a number, got 'tiny'" -- attnres --in "$tmp/a" --out "$tmp/o" --eps tiny
  expect 2 "missing --format" -- quant --in "$tmp/r" --out "$tmp/o"
  expect 2 "option '--format' must be one of" -- quant --in "$tmp/r" --out "$tmp/o" --format fp8
  expect 2 "--block must be one of" -- quant --in "$tmp/r" --out "$tmp/o" --format e4m3 --block 64x64
  expect 2 "MX scales are --scale floor|rceil, got 'xx'" -- dequant --in "$tmp/r" --out "$tmp/o" --format mxfp8 --scale xx
  expect 2 "--format nvfp4 uses --block 16" -- dequant --in "$tmp/r" --out "$tmp/o" --format nvfp4 --block 32
fi
[ $fail = 0 ] && echo "cli error handling: passed"
exit $fail
