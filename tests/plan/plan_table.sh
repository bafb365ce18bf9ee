#!/bin/sh
# plan_table.sh RECOMMENDED COMMAND...
# Runs COMMAND (`qtrain plan ... --all`, through mpiexec) and checks its table: exit code 0; at
# least one row; every row's dp x tp x pp is the GPUs of the "GPUs" line, printed once; a row
# says "yes" exactly when its total is at most the usable memory; rows that fit come first, each
# group by step time; the "recommended:" line names a row that fits and no fitting row is more
# than 1% faster. RECOMMENDED is "DP TP PP ZERO OFFLOAD RECOMPUTE" (e.g. "2 1 1 3 none no"; the
# recommended row), "any" (whichever), or "nothing" (the command must say that nothing fits).
set -u
if [ $# -lt 2 ]; then
  echo "usage: plan_table.sh RECOMMENDED COMMAND..." >&2
  exit 64
fi
want=$1
shift
# shellcheck source=SCRIPTDIR/../support/capture.sh
. "$(dirname "$0")/../support/capture.sh"
capture "$@"
echo "----"
fail() { echo "FAIL: $*"; exit 1; }
[ "$rc" -eq 0 ] || fail "exit code $rc, expected 0"
# The table's unit (GiB or MiB) is that of the usable memory printed below it.
awk -v want="$want" '
  /^GPUs / {
    gpus = $2
    for (i = 1; i < NF; ++i) if ($(i + 1) ~ /^GiB$/ && $(i + 2) == "usable") usable = $i
  }
  /^Layouts/ { mib = ($0 ~ / MiB /) }
  # Qwen3-MoE tables have an ep column after pp: kept in the key, then dropped from the fields.
  /^  dp  tp  pp  ep / { moe = 1 }
  moe && /^ +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+ +[0-3] +(none|cpu) +(yes|no) / {
    ep = " ep " $4; $4 = ""; $0 = " " $0
  }
  /^ +[0-9]+ +[0-9]+ +[0-9]+ +[0-3] +(none|cpu) +(yes|no) / {
    key = $1 " " $2 " " $3 (moe ? ep : "") " " $4 " " $5 " " $6
    if (key in seen) { print "FAIL: row " key " printed twice"; bad = 1 }
    seen[key] = 1; rows++
    if ($1 * $2 * $3 != gpus) { print "FAIL: row " key ": not " gpus " GPUs"; bad = 1 }
    total = $13; ok = $14; t = $15
    limit = mib ? usable * 1024 : usable
    if ((total <= limit) != (ok == "yes")) {
      print "FAIL: row " key ": total " total " against " limit " usable, but fits = " ok; bad = 1
    }
    if (ok == "yes") {
      if (nofit) { print "FAIL: row " key " fits but follows one that does not"; bad = 1 }
      if (fast == "" || t < fast) fast = t
      fit[key] = t
    } else nofit = 1
    if (ok == prev_ok && t < prev_t) { print "FAIL: row " key " is faster than the row before"; bad = 1 }
    prev_ok = ok; prev_t = t
  }
  /^recommended: / {
    # "recommended: dp 4 x tp 2 x pp 4, ZeRO-2, offload none, recompute off: ..." (Qwen3-MoE:
    # "pp 1 x ep 8, ZeRO-2, ...")
    rep = ""
    if ($10 == "x" && $11 == "ep") { rep = " ep " $12; sub(/,/, "", rep); $10 = $11 = $12 = ""; $0 = $0 }
    pp = $9; sub(/,/, "", pp)
    z = $10; sub(/ZeRO-/, "", z); sub(/,/, "", z)
    off = $12; sub(/,/, "", off)
    rc_ = $14; sub(/:/, "", rc_)
    rec = $3 " " $6 " " pp rep " " z " " off " " (rc_ == "on" ? "yes" : "no")
  }
  /^nothing fits / { nothing = 1 }
  END {
    if (usable == "" || gpus == "") { print "FAIL: no GPUs line with the usable memory"; exit 1 }
    if (rows == 0) { print "FAIL: no rows"; exit 1 }
    if (want == "nothing") {
      if (!nothing || rec != "") { print "FAIL: expected nothing to fit"; exit 1 }
      exit bad
    }
    if (rec == "") { print "FAIL: no recommended line"; exit 1 }
    if (!(rec in fit)) { print "FAIL: the recommended " rec " is not a row that fits"; exit 1 }
    if (fit[rec] > 1.01 * fast) { print "FAIL: recommended " rec " takes " fit[rec] " s, the fastest " fast; exit 1 }
    if (want != "any" && rec != want) { print "FAIL: recommended " rec ", expected " want; exit 1 }
    exit bad
  }' "$out" || fail "the table is inconsistent"
echo "PASS"
