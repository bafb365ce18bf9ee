#!/bin/sh
# plan_table.sh CHEAPEST FITS COMMAND...
# Runs COMMAND (`qtrain plan ...`, through mpiexec) and checks its table: exit code 0; one row
# for each ZeRO stage 0-3 with offload none and with cpu, each printed once; the rows of offload
# with ZeRO 0 and 1, and only they, say "not available"; each other row says "yes" exactly when
# its total is at most the usable memory of the "GPUs" line; FITS rows say "yes" ("all" of the 6
# available, "none" or a number); the "cheapest that fits" line names CHEAPEST ("2 none": stage
# and offload), or "nothing" when the command must say that nothing fits.
set -u
if [ $# -lt 3 ]; then
  echo "usage: plan_table.sh CHEAPEST FITS COMMAND..." >&2
  exit 64
fi
cheapest=$1
fits=$2
shift 2
# shellcheck source=SCRIPTDIR/../support/capture.sh
. "$(dirname "$0")/../support/capture.sh"
capture "$@"
echo "----"
fail() { echo "FAIL: $*"; exit 1; }
[ "$rc" -eq 0 ] || fail "exit code $rc, expected 0"
# The table's unit (GiB or MiB) is that of the usable memory printed below it.
awk -v want_fits="$fits" '
  /^GPUs / {
    for (i = 1; i < NF; ++i) if ($(i + 1) ~ /^GiB$/ && $(i + 2) == "usable") usable = $i
  }
  /^Peak GPU memory/ { mib = ($0 ~ /MiB/) }
  /^ +[0-3]\*? +(none|cpu) / {
    stage = $1; sub(/\*/, "", stage)
    key = stage " " $2
    if (key in seen) { print "FAIL: row " key " printed twice"; bad = 1 }
    seen[key] = 1; rows++
    if ($0 ~ / not available: /) {
      if (key != "0 cpu" && key != "1 cpu") { print "FAIL: row " key " is not available"; bad = 1 }
      unavailable++
      next
    }
    total = $8; ok = $9
    limit = mib ? usable * 1024 : usable
    if ((total <= limit) != (ok == "yes")) {
      print "FAIL: row " key ": total " total " against " limit " usable, but fits = " ok; bad = 1
    }
    if (ok == "yes") nfit++
  }
  END {
    if (usable == "") { print "FAIL: no usable memory on the GPUs line"; exit 1 }
    if (rows != 8) { print "FAIL: " rows " rows, expected 8 (stages 0-3 x none, cpu)"; exit 1 }
    if (unavailable != 2) { print "FAIL: " unavailable " rows not available, expected 2"; exit 1 }
    n = want_fits == "all" ? 6 : want_fits == "none" ? 0 : want_fits
    if (nfit != n) { print "FAIL: " nfit " settings fit, expected " n; exit 1 }
    exit bad
  }' "$out" || fail "the table is inconsistent"
if [ "$cheapest" = nothing ]; then
  [ "$(grep -c '^nothing fits ' "$out")" -eq 1 ] || fail "expected one 'nothing fits' line"
  grep -q '^cheapest that fits' "$out" && fail "a 'cheapest that fits' line although nothing fits"
else
  stage=${cheapest% *}
  offload=${cheapest#* }
  want="^cheapest that fits: optim.zero_stage = $stage, optim.offload = $offload "
  [ "$(grep -c "$want" "$out")" -eq 1 ] || fail "expected one line matching /$want/"
fi
echo "PASS"
