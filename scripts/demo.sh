#!/usr/bin/env bash
# The demo: installs what is missing (Debian 12 / Ubuntu 24.04), builds the CPU back end and trains
# the tiny Qwen3 deck inputs/tiny.ini on 2 MPI ranks, then shows the checkpoint it wrote.
#
#   bash scripts/demo.sh                       train from scratch (safe to rerun)
#   bash scripts/demo.sh --train.steps=50      extra arguments are deck overrides
#   QTRAIN_DEMO_RESUME=auto bash scripts/demo.sh   continue from the newest checkpoint instead
#   QTRAIN_NP=4 bash scripts/demo.sh           another rank count (the deck must allow it)
#
# Rerunning: the demo passes --checkpoint.resume=none, so each run trains the same steps from step 0.
# It first deletes the step_*.h5 files of the deck's checkpoint directory (checkpoints/tiny), so
# that no checkpoint of an earlier, longer demo run is left to look newer than this run's.
# qtrain starts the metrics file afresh for a run from step 0 and appends to it on a resume.
set -euo pipefail
# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# Only the CPU back end exists so far. A GPU demo would build `qt_build_preset cuda` here and run
# build-cuda/bin/qtrain with a deck that selects the CUDA back end.
qt_setup
cd "$QT_ROOT"

deck=inputs/tiny.ini
np=${QTRAIN_NP:-2}
resume=${QTRAIN_DEMO_RESUME:-none}
[ -r "$deck" ] || qt_die "$deck not found (run from a complete checkout)"

# Relative paths in the deck are taken from the working directory (the repository root here).
ckpt_dir=$(qt_ini_get "$deck" checkpoint dir checkpoints)
metrics=$(qt_ini_get "$deck" log metrics metrics.jsonl)
# A command-line override of these wins over the deck, as in qtrain itself.
overrides=()
for arg in "$@"; do
  case "$arg" in
    --checkpoint.dir=*) ckpt_dir=${arg#*=} ;;
    --log.metrics=*) metrics=${arg#*=} ;;
    --checkpoint.resume=*) resume=${arg#*=}; continue ;;  # passed once, below
  esac
  overrides+=("$arg")
done

if [ "$resume" = none ] && [ -d "$ckpt_dir" ]; then
  qt_log "fresh run: deleting earlier checkpoints $ckpt_dir/step_*.h5"
  find "$ckpt_dir" -maxdepth 1 \( -name 'step_*.h5' -o -name 'step_*.h5.tmp' \) -type f -delete
fi

cmd=(mpirun -np "$np" --oversubscribe build/bin/qtrain "$deck" "--checkpoint.resume=$resume"
     "${overrides[@]}")
qt_log "running: ${cmd[*]}"
"${cmd[@]}"

echo
qt_log "deck:        $deck"
if [ -n "$metrics" ]; then
  qt_log "metrics:     $metrics ($( [ -f "$metrics" ] && wc -l <"$metrics" || echo 0) lines)"
fi
qt_log "checkpoints: $ckpt_dir/"
# step_NNNNNNNN.h5 is zero-padded, so the last name in sort order is the newest step.
newest=$(find "$ckpt_dir" -maxdepth 1 -name 'step_*.h5' 2>/dev/null | sort | tail -n 1)
if [ -z "$newest" ]; then
  qt_die "no checkpoint step_*.h5 found in $ckpt_dir"
fi
ls -l "$ckpt_dir"
echo
qt_log "h5ls -r $newest, without /optim (the AdamW moments, same names):"
listing=$(h5ls -r "$newest")
grep -v '^/optim/' <<<"$listing" | head -n 24
qt_log "... $(grep -c Dataset <<<"$listing") datasets in all; root attribute step = $(
  h5dump -a /step "$newest" | sed -n 's/^ *(0): *//p')"
echo
qt_log "an interrupted run continues from its newest checkpoint with --checkpoint.resume=auto"
