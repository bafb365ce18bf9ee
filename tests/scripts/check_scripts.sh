#!/usr/bin/env bash
# check_scripts.sh REPO: shellcheck over the repository's shell scripts (scripts/: *.sh, *.sbatch,
# *.pbs), then the dry runs of the Qwen3-32B batch scripts: each must exit 0 without launching
# anything and print the launch command and the layout; a layout that cannot run must exit 2
# naming the key. Needs shellcheck (scripts/test.sh installs it).
set -euo pipefail
repo=$1
cd "$repo"
fail=0
bad() { echo "FAIL: $*"; fail=1; }

if ! command -v shellcheck >/dev/null 2>&1; then
  echo "FAIL: shellcheck is not installed (apt-get install shellcheck; scripts/test.sh installs it)"
  exit 1
fi
mapfile -t files < <(find scripts -type f \( -name '*.sh' -o -name '*.sbatch' -o -name '*.pbs' \) | sort)
echo "shellcheck -x ${files[*]}"
shellcheck -x "${files[@]}" || bad "shellcheck"

# A qtrain that leaves a mark if anything launches it.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf '#!/bin/sh\ntouch "%s/launched"\n' "$tmp" >"$tmp/qtrain"
chmod +x "$tmp/qtrain"
# Neither batch system is here; clear what a CI job under one might have set.
clean=(env -u SLURM_JOB_NUM_NODES -u SLURM_NTASKS_PER_NODE -u SLURM_CPUS_PER_TASK -u SLURM_SUBMIT_DIR
  -u PBS_NODEFILE -u PBS_O_WORKDIR -u QTRAIN_ARGS -u DECK -u QTRAIN_LAUNCHER
  QTRAIN_BIN="$tmp/qtrain" "QTRAIN_GPU_NUMA=0,0,0,0,1,1,1,1")

# expect NAME CODE COMMAND... -- REGEX...: COMMAND exits CODE, nothing launched, each REGEX matches
# a line of its output.
expect() {
  local name=$1 code=$2 rc=0 out re
  shift 2
  local -a cmd=()
  while [ "$1" != -- ]; do cmd+=("$1"); shift; done
  shift
  out=$("${clean[@]}" "${cmd[@]}" 2>&1) || rc=$?
  printf -- '---- %s (exit %s)\n%s\n' "$name" "$rc" "$out"
  [ "$rc" -eq "$code" ] || bad "$name: exit $rc, expected $code"
  [ ! -e "$tmp/launched" ] || bad "$name: a dry run launched qtrain"
  for re in "$@"; do
    grep -qE -- "$re" <<<"$out" || bad "$name: no line matches /$re/"
  done
}

layout='^layout   world 32 = pp 2 x dp 4 x tp 4 \(tp innermost\); optim\.zero_stage = 1; train\.device = cuda$'
job='^job      4 nodes x 8 ranks per node = 32 ranks, one GPU each'
numa='^numa     GPU NUMA nodes 0,0,0,0,1,1,1,1 \(QTRAIN_GPU_NUMA\)$'
expect slurm_srun 0 env DRY_RUN=1 bash scripts/slurm/qwen3_32b.sh -- "$job" "$layout" "$numa" \
  "^command  srun --mpi=pmix --ntasks-per-node=8 --distribution=block:block --cpus-per-task=[0-9]+ --cpu-bind=map_ldom:0,0,0,0,1,1,1,1 $tmp/qtrain inputs/qwen3_32b\.ini$" \
  '^requeue  SIGUSR1 300 s before the time limit' '^nccl     NCCL_DEBUG=WARN'
expect slurm_mpirun 0 env QTRAIN_LAUNCHER=mpirun bash scripts/slurm/qwen3_32b.sh --dry-run --train.steps=10 -- \
  "$layout" "^command  mpirun -np 32 --map-by ppr:4:numa --bind-to numa $tmp/qtrain inputs/qwen3_32b\.ini --train\.steps=10$" \
  '^binding  mpirun --map-by ppr:4:numa --bind-to numa: 4 ranks on each NUMA node'
expect pbs 0 env DRY_RUN=1 bash scripts/pbs/qwen3_32b.pbs -- "$job" "$layout" "$numa" \
  "^command  mpirun -np 32 --map-by ppr:4:numa --bind-to numa $tmp/qtrain inputs/qwen3_32b\.ini$" \
  '^rerun    SIGUSR1 300 s before the walltime'
expect pbs_args 0 env DRY_RUN=1 QTRAIN_ARGS="--optim.lr=2e-5 --mesh.tp=8 --mesh.pp=1" bash scripts/pbs/qwen3_32b.pbs -- \
  '^layout   world 32 = pp 1 x dp 4 x tp 8 ' "--optim\.lr=2e-5 --mesh\.tp=8 --mesh\.pp=1$"
expect slurm_tp_across_nodes 2 bash scripts/slurm/qwen3_32b.sh --dry-run --mesh.dp=2 --mesh.tp=16 --mesh.pp=1 -- \
  '^error    mesh\.tp = 16 does not divide the 8 ranks per node'
expect pbs_world 2 bash scripts/pbs/qwen3_32b.pbs --dry-run --mesh.dp=16 -- \
  '^error    mesh\.dp x mesh\.tp x mesh\.pp = 16 x 4 x 2 is not the job.s 32 ranks'

[ "$fail" -eq 0 ] && echo PASS
exit "$fail"
