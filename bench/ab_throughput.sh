#!/usr/bin/env bash
# A/B training throughput of two builds on one GPU, in one call: qtrain runs of build A and build B
# alternate (A B A B ...) so that clock and power drift touch both alike. Each run is the qtrain
# run of bench/train_throughput.sh (2 x 4096 tokens a step, synthetic tokens, 30 steps); tokens/s
# is the mean of the logged intervals after step 20. Prints every run and, per model, the mean of
# B over the mean of A.
#   usage: bench/ab_throughput.sh BUILD_A BUILD_B OUT_DIR [MODEL[:LAYERS] ...]  (default qwen3-1.7b)
#   ROUNDS=2: A/B pairs per model; QTRAIN_OPTS as in train_throughput.sh (both builds)
# A build directory holds bin/qtrain and lib/libqtrain_engine.so: a CUDA build, or a copy of its
# bin/ and lib/ (e.g. of the commit before a change, to measure the change). Run it on the GPU
# machine from the repository root with the runtime kit in .kit (docs/cuda.md).
set -uo pipefail
build_a=${1:?build A}; build_b=${2:?build B}; out=${3:?output dir}; shift 3
models=("${@:-qwen3-1.7b}")
mkdir -p "$out"
for spec in "${models[@]}"; do
  tag=${spec/:/-L}
  for ((r = 1; r <= ${ROUNDS:-2}; ++r)); do
    for side in a b; do
      build=$build_a; [[ $side == b ]] && build=$build_b
      dir=$out/$tag-$side$r
      BASELINES=0 CEILING=0 bash bench/train_throughput.sh "$build" "$dir" "$spec" >"$dir.log" 2>&1 \
        || echo "$tag $side$r failed: see $dir.log"
    done
  done
done
PYTHONPATH=bench python3 - "$out" "${ROUNDS:-2}" "${models[@]}" <<'PY'
import sys
from summarize_throughput import late_tokens_per_s_of as tps, print_ab
out, rounds, models = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
for spec in models:
    tag = spec.replace(":", "-L")
    print_ab(tag, {side: [tps(f"{out}/{tag}-{side}{r}/qtrain-{tag}.jsonl")
                          for r in range(1, rounds + 1)] for side in "ab"})
PY
