#!/usr/bin/env bash
# Weak scaling of data parallelism on one host: the same model and per-GPU batch (2 x 4096 tokens
# a step on each GPU) on 1 and on N GPUs, synthetic tokens, no checkpoints. Prints tokens/s of each
# run (the mean of the logged intervals after step 20) and the efficiency
#   tokens/s on N GPUs / (N x tokens/s on 1 GPU).
#   usage: bench/weak_scaling.sh BUILD_DIR OUT_DIR [MODEL] [N] [extra qtrain options...]
#   e.g.   bench/weak_scaling.sh build-cuda OUT qwen3-0.6b 2 --optim.zero_stage=1
# Run it on the GPU machine from the repository root with the runtime kit in .kit (docs/cuda.md).
set -uo pipefail
build=${1:?build dir}; out=${2:?output dir}; model=${3:-qwen3-0.6b}; n=${4:-2}
shift $(( $# < 4 ? $# : 4 ))
mkdir -p "$out"
for np in 1 "$n"; do
  ( source .kit/kit-env.sh
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    mpirun -np "$np" --bind-to none "$build/bin/qtrain" inputs/qwen3-0.6b.ini --model.preset="$model" \
      --train.device=cuda --train.seq_len=4096 --train.micro_batch=2 \
      --train.global_batch=$((2 * np)) --train.steps=30 --train.recompute=false \
      --data.source=synthetic --checkpoint.every=-1 --checkpoint.resume=none --log.every=5 \
      --log.metrics="$out/weak-$model-np$np.jsonl" --optim.warmup_steps=5 "$@" ) \
    >"$out/weak-$model-np$np.log" 2>&1 || echo "np $np failed: see $out/weak-$model-np$np.log"
  grep -E "^step|error" "$out/weak-$model-np$np.log" | tail -2
done
PYTHONPATH=bench python3 - "$out" "$model" "$n" <<'PY'
import json, sys
from summarize_throughput import late_tokens_per_s
out, model, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
def tps(np):
    return late_tokens_per_s([json.loads(l) for l in open(f"{out}/weak-{model}-np{np}.jsonl")])
one, many = tps(1), tps(n)
print(f"{model}: 1 GPU {one:.0f} tokens/s, {n} GPUs {many:.0f} tokens/s: "
      f"weak-scaling efficiency {100 * many / (n * one):.1f}%")
PY
