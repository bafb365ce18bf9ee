#!/usr/bin/env bash
# Training throughput of qtrain (train.device = cuda) next to the PyTorch + transformers baseline
# (bench/baselines/hf_train.py, eager and torch.compile), measured in the same run on the same GPU,
# 2 sequences x 4096 tokens a step, synthetic tokens, no checkpoints.
#   usage: bench/train_throughput.sh BUILD_DIR OUT_DIR [MODEL[:LAYERS] ...]   (default: qwen3-0.6b)
#   e.g. qwen3-0.6b qwen3-1.7b qwen3-8b:8   (the last: eight Qwen3-8B-shaped layers)
#   COMPILED="qwen3-0.6b qwen3-1.7b": the models also measured under torch.compile (default 0.6b)
#   QTRAIN_OPTS="--optim.overlap_update=false ...": more qtrain options (word-split)
#   BASELINES=0: qtrain only (no PyTorch runs); CEILING=0: skip the cuBLASLt ceiling measurement
#   LORA=1: LoRA instead (docs/finetune.md): qtrain with [lora] r=8, alpha=16, dropout 0 on
#     q/k/v/o_proj next to PEFT (bench/baselines/peft_train.py) with the same settings; the models
#     in LORA_B1 (default qwen3-8b) run one sequence a step, PEFT with gradient checkpointing.
# Run it on the GPU machine from the repository root with the runtime kit in .kit (docs/cuda.md).
# Then `python3 bench/summarize_throughput.py OUT_DIR` prints tokens/s, model TFLOP/s and MFU.
set -uo pipefail
build=${1:?build dir}; out=${2:?output dir}; shift 2
models=("${@:-qwen3-0.6b}")
mkdir -p "$out"
if [[ ${LORA:-0} == 1 ]]; then
  for spec in "${models[@]}"; do
    model=${spec%%:*}; layers=${spec#"$model"}; layers=${layers#:}
    tag=$model${layers:+-L$layers}
    qt_extra=(); peft_extra=(); batch=2
    [[ -n $layers ]] && qt_extra=(--model.num_layers="$layers") && peft_extra=(--layers "$layers")
    if [[ " ${LORA_B1:-qwen3-8b} " == *" $spec "* ]]; then batch=1; peft_extra+=(--grad-ckpt); fi
    ( source .kit/kit-env.sh
      export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
      mpirun -np 1 --bind-to none "$build/bin/qtrain" inputs/qwen3-0.6b.ini --model.preset="$model" "${qt_extra[@]}" \
        --train.device=cuda --train.seq_len=4096 --train.micro_batch=$batch \
        --train.global_batch=$batch --train.steps=30 --train.recompute=false \
        --data.source=synthetic --checkpoint.every=-1 --checkpoint.resume=none --log.every=5 \
        --log.metrics="$out/qtrain-lora-$tag.jsonl" --optim.warmup_steps=5 --lora.r=8 \
        --lora.alpha=16 --lora.dropout=0 --lora.targets=q_proj,k_proj,v_proj,o_proj ) \
      >"$out/qtrain-lora-$tag.log" 2>&1 || echo "qtrain LoRA $model failed: see $out/qtrain-lora-$tag.log"
    grep -E "^step|error" "$out/qtrain-lora-$tag.log" | tail -2
    python3 bench/baselines/peft_train.py --model "$model" "${peft_extra[@]}" --seq-len 4096 \
      --batch $batch >"$out/peft-$tag.json" 2>"$out/peft-$tag.err" || tail -3 "$out/peft-$tag.err"
    cat "$out/peft-$tag.json"
  done
  exit 0
fi
# The cuBLASLt bf16 ceiling on this GPU (8192^3), printed beside MFU by summarize_throughput.py.
if [[ ${CEILING:-1} != 0 && -x $build/bin/qtrain_bench_gemm_cuda ]]; then
  ( source .kit/kit-env.sh
    "$build/bin/qtrain_bench_gemm_cuda" --benchmark_filter='ceiling/8192\^3/TN' ) >"$out/gemm-ceiling.log" 2>&1
  grep "measured cuBLAS ceiling" "$out/gemm-ceiling.log" || echo "gemm ceiling: see $out/gemm-ceiling.log"
fi
for spec in "${models[@]}"; do
  model=${spec%%:*}; layers=${spec#"$model"}; layers=${layers#:}
  tag=$model${layers:+-L$layers}
  qt_layers=(); hf_layers=()
  [[ -n $layers ]] && qt_layers=(--model.num_layers="$layers") && hf_layers=(--layers "$layers")
  ( source .kit/kit-env.sh
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    mpirun -np 1 --bind-to none "$build/bin/qtrain" inputs/qwen3-0.6b.ini --model.preset="$model" "${qt_layers[@]}" \
      --train.device=cuda --train.seq_len=4096 --train.micro_batch=2 --train.global_batch=2 \
      --train.steps=30 --train.recompute=false --data.source=synthetic --checkpoint.every=-1 \
      --checkpoint.resume=none --log.every=5 --log.metrics="$out/qtrain-$tag.jsonl" \
      --optim.warmup_steps=5 ${QTRAIN_OPTS:-} ) >"$out/qtrain-$tag.log" 2>&1 \
    || echo "qtrain $model failed: see $out/qtrain-$tag.log"
  grep -E "^step|error" "$out/qtrain-$tag.log" | tail -3
  modes=(eager); [[ " ${COMPILED:-qwen3-0.6b} " == *" $spec "* ]] && modes+=(compile)
  [[ ${BASELINES:-1} == 0 ]] && modes=()
  for mode in "${modes[@]}"; do
    flag=""; [[ $mode == compile ]] && flag=--compile
    python3 bench/baselines/hf_train.py --model "$model" "${hf_layers[@]}" --seq-len 4096 --batch 2 \
      $flag >"$out/torch-$mode-$tag.json" 2>"$out/torch-$mode-$tag.err" \
      || tail -3 "$out/torch-$mode-$tag.err"
    cat "$out/torch-$mode-$tag.json"
  done
done
