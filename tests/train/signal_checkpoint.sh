#!/usr/bin/env bash
# A running job that receives SIGUSR1 (forwarded by mpirun; Slurm's --signal sends it too)
# writes a checkpoint at the end of the current step and exits 0; resuming continues from it.
# usage: signal_checkpoint.sh <mpiexec> <qtrain> <deck>
set -euo pipefail
mpiexec=$1 qtrain=$2 deck=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
common=(--checkpoint.dir="$work/ckpt" --checkpoint.every=0 --log.every=1 --log.metrics="$work/m.jsonl"
        --train.steps=100000 --optim.warmup_steps=10)
"$mpiexec" -n 2 --oversubscribe "$qtrain" "$deck" --checkpoint.resume=none "${common[@]}" >"$work/out1" 2>&1 &
pid=$!
for _ in $(seq 1 600); do  # wait for a few steps (at most 60 s)
  [[ -f "$work/m.jsonl" && $(wc -l <"$work/m.jsonl") -ge 3 ]] && break
  sleep 0.1
done
kill -USR1 "$pid"
rc=0; wait "$pid" || rc=$?
cat "$work/out1" | tail -5
[[ $rc -eq 0 ]] || { echo "FAIL: exit code $rc after SIGUSR1"; exit 1; }
ckpt=$(ls "$work/ckpt"/step_*.h5 | tail -1)
[[ -n "$ckpt" ]] || { echo "FAIL: no checkpoint written on SIGUSR1"; exit 1; }
step=$(basename "$ckpt" .h5); step=$((10#${step#step_}))
last=$(wc -l <"$work/m.jsonl")
[[ $step -eq $last ]] || { echo "FAIL: checkpoint at step $step but $last steps were logged"; exit 1; }
"$mpiexec" -n 2 --oversubscribe "$qtrain" "$deck" --checkpoint.resume=auto --train.stop_at=$((step + 2)) "${common[@]}" >"$work/out2" 2>&1
grep -q "resumed from .*step_$(printf %08d "$step").h5" "$work/out2" || { echo "FAIL: did not resume"; cat "$work/out2"; exit 1; }
echo "PASS: checkpoint at step $step on SIGUSR1, resumed from it"
