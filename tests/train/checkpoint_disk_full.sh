#!/usr/bin/env bash
# A checkpoint write that fails (here: the file size limit of `ulimit -f`, as a full disk would)
# ends every rank with exit 2 and one message naming the path and the OS error, removes the
# partial file and keeps the earlier checkpoints as they were.
# usage: checkpoint_disk_full.sh <mpiexec> <qtrain> <deck>
set -euo pipefail
mpiexec=$1 qtrain=$2 deck=$3
# shellcheck source=tests/train/run_lib.sh
. "$(dirname "$0")/run_lib.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
common=(--checkpoint.dir="$work/ckpt" --checkpoint.every=1 --log.every=1 --log.metrics="$work/m.jsonl")

"$mpiexec" -n 2 --oversubscribe "$qtrain" "$deck" --train.steps=2 "${common[@]}" >"$work/a.out" 2>&1 ||
  fail "first run: $(tail -3 "$work/a.out")"
before=$(cd "$work/ckpt" && md5sum step_*.h5)
size=$(stat -c %s "$work/ckpt/step_00000001.h5")

# Files of each rank limited to half a checkpoint (ulimit -f counts 1024-byte blocks). The shared
# memory transport is left out: it sizes files too.
rc=0
timeout 50 "$mpiexec" -n 2 --oversubscribe --mca btl self,tcp sh -c \
  'ulimit -f "$1"; shift; exec "$@"' sh $((size / 2048)) \
  "$qtrain" "$deck" --train.steps=4 "${common[@]}" >"$work/b.out" 2>&1 || rc=$?
grep -v '^[a-z_]* = \|^\[\|^$\|^#' "$work/b.out" | tail -5
[[ $rc -eq 2 ]] || fail "exit code $rc, expected 2"
n=$(count_lines "^qtrain: error: cannot write checkpoint .*/step_00000003\.h5: .*File too large.*The partial file was removed; the earlier checkpoints are kept" "$work/b.out")
[[ $n -eq 1 ]] || fail "$n lines report the failed write, expected 1"
[[ $(count_lines "internal error|HDF5-DIAG" "$work/b.out") -eq 0 ]] || fail "internal error or HDF5 stack printed"
for f in "$work/ckpt"/*.tmp; do [[ -e "$f" ]] && fail "a partial .tmp file was left: $f"; done
[[ ! -e "$work/ckpt/step_00000003.h5" ]] || fail "a step 3 checkpoint exists"
after=$(cd "$work/ckpt" && md5sum step_*.h5)
[[ "$before" == "$after" ]] || fail "the earlier checkpoints changed: $after"
echo "PASS: failed write reported once with exit 2, partial file removed, earlier checkpoints kept"
