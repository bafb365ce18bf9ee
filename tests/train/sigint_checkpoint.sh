#!/usr/bin/env bash
# SIGINT (what srun forwards on Ctrl-C) asks for a checkpoint at the end of the step, like
# SIGTERM and SIGUSR1; a second SIGINT ends the ranks at once, without a checkpoint.
# usage: sigint_checkpoint.sh <mpiexec> <qtrain> <deck>
set -euo pipefail
mpiexec=$1 qtrain=$2 deck=$3
# shellcheck source=tests/train/run_lib.sh
. "$(dirname "$0")/run_lib.sh"
work=$(mktemp -d)
pid=
trap '[[ -z $pid ]] || kill -9 $pid 2>/dev/null; rm -rf "$work"' EXIT
common=(--checkpoint.every=0 --log.every=1 --train.steps=100000 --optim.warmup_steps=10)

# 1. One SIGINT to every rank: checkpoint of the step reached, exit 0.
"$mpiexec" -n 2 --oversubscribe "$qtrain" "$deck" --checkpoint.dir="$work/a" \
  --log.metrics="$work/a.jsonl" "${common[@]}" >"$work/a.out" 2>&1 &
pid=$!
wait_lines "$work/a.jsonl" 3
# shellcheck disable=SC2046  # one pid per word
kill -INT $(ranks_of $pid)
rc=0; wait $pid || rc=$?; pid=
tail -3 "$work/a.out"
[[ $rc -eq 0 ]] || fail "exit code $rc after one SIGINT"
ckpt=$(ls "$work/a"/step_*.h5 2>/dev/null | tail -1)
[[ -n "$ckpt" ]] || fail "no checkpoint written on SIGINT"
step=$(basename "$ckpt" .h5); step=$((10#${step#step_}))
[[ $step -eq $(wc -l <"$work/a.jsonl") ]] || fail "checkpoint at step $step, not at the last step logged"
[[ $(count_lines "stopping at step $step on signal 2" "$work/a.out") -eq 1 ]] || fail "no stop message"

# 2. Two SIGINTs apart (Ctrl-C twice): the ranks end on the second, no checkpoint. Long steps
# (seq_len 1024) make the second arrive within the step.
"$mpiexec" -n 2 --oversubscribe "$qtrain" "$deck" --checkpoint.dir="$work/b" \
  --log.metrics="$work/b.jsonl" --train.seq_len=1024 "${common[@]}" >"$work/b.out" 2>&1 &
pid=$!
wait_lines "$work/b.jsonl" 1
ranks=$(ranks_of $pid)
kill -INT $ranks
sleep 0.2
kill -INT $ranks 2>/dev/null || true
rc=0; wait $pid || rc=$?; pid=
tail -3 "$work/b.out"
[[ $rc -ne 0 ]] || fail "exit code 0 after two SIGINTs: the second did not end the ranks"
ls "$work/b"/step_*.h5 >/dev/null 2>&1 && fail "a checkpoint was written after two SIGINTs"
echo "PASS: one SIGINT checkpointed step $step and stopped; two ended the run at once (exit $rc)"
