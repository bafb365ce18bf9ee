#!/usr/bin/env bash
# A/B training throughput of two builds on N GPUs with data parallelism, in one call: qtrain runs
# of build A and build B alternate (A B A B ...) so that clock and power drift touch both alike.
# Each run: MODEL at dp N (default 2) with optim.zero_stage = ZERO (default 3: the most
# collectives a second), 2 x 4096 tokens a GPU a step, synthetic tokens, 30 steps, no
# checkpoints; tokens/s is the mean of the logged intervals after step 20. For changes to the
# collectives' path, which bench/ab_throughput.sh (one GPU) does not exercise. Prints every run
# and the mean of B over the mean of A.
#   usage: bench/ab_dp_throughput.sh BUILD_A BUILD_B OUT_DIR [N] [MODEL] [extra qtrain options...]
#   ROUNDS=2: A/B pairs; e.g. bench/ab_dp_throughput.sh OLD NEW OUT 2 qwen3-0.6b
# A build directory holds bin/qtrain and lib/libqtrain_engine.so (a CUDA build or a bundle of one,
# scripts/device-bundle.sh). Run it on the GPU machine from the repository root; it sources the
# runtime kit (.kit, docs/cuda.md) when there is one.
set -uo pipefail
build_a=${1:?build A}; build_b=${2:?build B}; out=${3:?output dir}
n=${4:-2}; model=${5:-qwen3-0.6b}
shift $(( $# < 5 ? $# : 5 ))
mkdir -p "$out"
[ -f .kit/kit-env.sh ] && source .kit/kit-env.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
for ((r = 1; r <= ${ROUNDS:-2}; ++r)); do
  for side in a b; do
    build=$build_a; [[ $side == b ]] && build=$build_b
    mpirun -np "$n" --bind-to none "$build/bin/qtrain" inputs/qwen3-0.6b.ini \
      --model.preset="$model" \
      --train.device=cuda --mesh.dp="$n" --optim.zero_stage="${ZERO:-3}" --train.seq_len=4096 \
      --train.micro_batch=2 --train.global_batch=$((2 * n)) --train.steps=30 \
      --train.recompute=false --data.source=synthetic --checkpoint.every=-1 \
      --checkpoint.resume=none --log.every=5 --optim.warmup_steps=5 \
      --log.metrics="$out/$side$r.jsonl" "$@" >"$out/$side$r.log" 2>&1 \
      || echo "$side$r failed: see $out/$side$r.log"
  done
done
PYTHONPATH=bench python3 - "$out" "${ROUNDS:-2}" "$n" <<'PY'
import sys
from summarize_throughput import late_tokens_per_s_of as tps, print_ab
out, rounds, n = sys.argv[1], int(sys.argv[2]), sys.argv[3]
print_ab(f"dp {n}", {side: [tps(f"{out}/{side}{r}.jsonl") for r in range(1, rounds + 1)]
                     for side in "ab"})
PY
