#!/usr/bin/env bash
# One run at a time in a checkpoint directory: a second run is refused (exit 2, one message
# naming the holder) while the first keeps going; the lock of a run killed with SIGKILL is stale
# and the next run takes it over; a finished run leaves no lock behind.
# usage: checkpoint_dir_lock.sh <mpiexec> <qtrain> <deck>
set -euo pipefail
mpiexec=$1 qtrain=$2 deck=$3
# shellcheck source=tests/train/run_lib.sh
. "$(dirname "$0")/run_lib.sh"
work=$(mktemp -d)
pid=
trap '[[ -z $pid ]] || kill -9 $pid $(ranks_of $pid) 2>/dev/null; rm -rf "$work"' EXIT
common=(--checkpoint.dir="$work/ckpt" --checkpoint.every=5 --log.every=1 --train.steps=100000)

"$mpiexec" -n 2 --oversubscribe "$qtrain" "$deck" --log.metrics="$work/a.jsonl" "${common[@]}" \
  >"$work/a.out" 2>&1 &
pid=$!
wait_lines "$work/a.jsonl" 2
holder=$(cat "$work/ckpt/.qtrain.lock")
echo "lock: $holder"

# 1. A second run on the same directory.
rc=0
timeout 50 "$mpiexec" -n 2 --oversubscribe "$qtrain" "$deck" --log.metrics="$work/b.jsonl" \
  "${common[@]}" >"$work/b.out" 2>&1 || rc=$?
grep -v '^[a-z_]* = \|^\[\|^$\|^#' "$work/b.out" | tail -4
[[ $rc -eq 2 ]] || fail "second run: exit code $rc, expected 2"
n=$(count_lines "^qtrain: error: checkpoint.dir = .* is in use by another qtrain run \(host .*, pid [0-9]+, started " "$work/b.out")
if [[ $n -ne 1 ]]; then
  echo "--- the second run's output, its deck's key lines left out:"
  grep -v '^[a-z_]* = ' "$work/b.out" || true
  fail "second run: $n lines name the holder, expected 1"
fi
[[ ! -e "$work/b.jsonl" ]] || fail "the refused run wrote metrics"
kill -0 $pid || fail "the first run died"

# 2. SIGKILL every rank of the first run: its lock file stays, but nobody holds it.
# shellcheck disable=SC2046  # one pid per word
kill -9 $(ranks_of $pid)
wait $pid || true
pid=
[[ -f "$work/ckpt/.qtrain.lock" ]] || fail "the killed run's lock file is gone (nothing to take over)"
rc=0
timeout 50 "$mpiexec" -n 2 --oversubscribe "$qtrain" "$deck" --log.metrics="$work/c.jsonl" \
  "${common[@]}" --train.stop_at=12 >"$work/c.out" 2>&1 || rc=$?
tail -3 "$work/c.out"
[[ $rc -eq 0 ]] || fail "run after the killed one: exit code $rc"
[[ $(count_lines "^taking over the stale lock .* of a run that is no longer running" "$work/c.out") -eq 1 ]] ||
  fail "no message about taking over the stale lock"
[[ ! -e "$work/ckpt/.qtrain.lock" ]] || fail "a finished run left its lock file"
echo "PASS: second run refused while the first ran; stale lock taken over; released at the end"
