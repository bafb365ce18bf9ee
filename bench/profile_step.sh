#!/usr/bin/env bash
# Per-kernel GPU time of one training step of qtrain (train.device = cuda), measured with Nsight
# Compute (each kernel serialised and timed alone, so the sum is a little above the real step).
#   usage: bench/profile_step.sh BUILD_DIR OUT_DIR MODEL[:LAYERS] [extra qtrain options...]
# Runs 4 steps and profiles step 3 (QTRAIN_CUDA_PROFILE_STEPS=2:3), then prints the time by kernel
# group with bench/summarize_kernels.py. Run on the GPU machine with the runtime kit in .kit.
set -uo pipefail
build=${1:?build dir}; out=${2:?output dir}; spec=${3:?model}; shift 3
model=${spec%%:*}; layers=${spec#"$model"}; layers=${layers#:}
tag=$model${layers:+-L$layers}
qt_layers=(); [[ -n $layers ]] && qt_layers=(--model.num_layers="$layers")
ncu=${NCU:-$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}
mkdir -p "$out"
( source .kit/kit-env.sh
  export QTRAIN_CUDA_PROFILE_STEPS=2:3
  "$ncu" --profile-from-start off --metrics gpu__time_duration.sum --csv --page raw \
    "$build/bin/qtrain" inputs/qwen3-0.6b.ini --model.preset="$model" "${qt_layers[@]}" \
    --train.device=cuda --train.seq_len=4096 --train.micro_batch=2 --train.global_batch=2 \
    --train.steps=4 --train.recompute=false --data.source=synthetic --checkpoint.every=-1 \
    --checkpoint.resume=none --log.every=1 "$@" ) >"$out/ncu-$tag.csv" 2>"$out/ncu-$tag.err"
python3 "$(dirname "$0")/summarize_kernels.py" "$out/ncu-$tag.csv" | tee "$out/kernels-$tag.txt"
