#!/usr/bin/env bash
# Training throughput of qtrain (train.device = cuda) next to the PyTorch + transformers baseline
# (bench/baselines/hf_train.py, eager and torch.compile), measured in the same run on the same GPU,
# 2 sequences x 4096 tokens a step, synthetic tokens, no checkpoints.
#   usage: bench/train_throughput.sh BUILD_DIR OUT_DIR [MODEL ...]   (default: qwen3-0.6b)
#   COMPILED="qwen3-0.6b qwen3-1.7b": the models also measured under torch.compile (default 0.6b)
# Run it on the GPU machine from the repository root with the runtime kit in .kit (docs/cuda.md).
# qtrain's step log gives tokens/s; bench/summarize_throughput.py turns the logs into the table
# (model TFLOP/s and MFU with FLOPs per token = 6N + 12 L H_q T, against 989 TFLOP/s).
set -uo pipefail
build=${1:?build dir}; out=${2:?output dir}; shift 2
models=("${@:-qwen3-0.6b}")
mkdir -p "$out"
for model in "${models[@]}"; do
  ( source .kit/kit-env.sh
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    mpirun -np 1 "$build/bin/qtrain" inputs/qwen3-0.6b.ini --model.preset="$model" \
      --train.device=cuda --train.seq_len=4096 --train.micro_batch=2 --train.global_batch=2 \
      --train.steps=30 --train.recompute=false --data.source=synthetic --checkpoint.every=-1 \
      --checkpoint.resume=none --log.every=5 --log.metrics="$out/qtrain-$model.jsonl" \
      --optim.warmup_steps=5 ) >"$out/qtrain-$model.log" 2>&1 \
    || echo "qtrain $model failed: see $out/qtrain-$model.log"
  grep -E "^step|error" "$out/qtrain-$model.log" | tail -3
  modes=(eager); [[ " ${COMPILED:-qwen3-0.6b} " == *" $model "* ]] && modes+=(compile)
  for mode in "${modes[@]}"; do
    flag=""; [[ $mode == compile ]] && flag=--compile
    python3 bench/baselines/hf_train.py --model "$model" --seq-len 4096 --batch 2 $flag \
      >"$out/torch-$mode-$model.json" 2>"$out/torch-$mode-$model.err" \
      || tail -3 "$out/torch-$mode-$model.err"
    cat "$out/torch-$mode-$model.json"
  done
done
