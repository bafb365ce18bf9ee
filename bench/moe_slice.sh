#!/usr/bin/env bash
# Qwen3-MoE training throughput on one GPU: a 4-layer slice of Qwen3-30B-A3B at its real shapes
# (preset qwen3-30b-a3b, model.num_layers = 4; 128 experts of width 768, 8 a token), 2 sequences
# x 4096 tokens a step, synthetic tokens, no checkpoints; qtrain (train.device = cuda) next to
# PyTorch + transformers (bench/baselines/hf_moe_train.py: grouped_mm experts, AdamW, causal LM
# loss) in the same run on the same GPU. Prints tokens/s of both, the ratio, and MFU counted with
# the active experts only and causal attention halved (bf16 dense peak PEAK_TFLOPS, default 989:
# H100 SXM).
#   usage: bench/moe_slice.sh BUILD_DIR OUT_DIR
#   LAYERS=4 STEPS=40: the slice and qtrain's steps (tokens/s: the mean of the second half's log
#   lines); BASELINE=0: qtrain only; EXTRA="--model.moe_capacity_factor=1.25 ...": more qtrain
#   options
# The GPU time by kernel group of one step: bench/profile_step.sh BUILD OUT qwen3-30b-a3b:4
#   --model.router_aux_loss_coef=0 (Nsight Compute; nsys is not on the GPU machine).
# Run it on the GPU machine from the repository root with the runtime kit in .kit (docs/cuda.md);
# python runs outside the kit.
set -uo pipefail
build=${1:?build dir}; out=${2:?output dir}
layers=${LAYERS:-4}; steps=${STEPS:-40}
mkdir -p "$out"
qt_args=(inputs/qwen3-0.6b.ini --model.preset=qwen3-30b-a3b --model.num_layers="$layers"
  --model.router_aux_loss_coef=0 --train.device=cuda --train.seq_len=4096 --train.micro_batch=2
  --train.global_batch=2 --train.steps="$steps" --train.recompute=false --data.source=synthetic
  --checkpoint.every=-1 --checkpoint.resume=none --log.every=5 --optim.warmup_steps=5
  --optim.lr=1e-4 --optim.min_lr=1e-4 --optim.weight_decay=0.1)  # the baseline's AdamW
# shellcheck disable=SC2206  # EXTRA is a list of options
qt_args+=(${EXTRA:-})
( source .kit/kit-env.sh
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  mpirun -np 1 --bind-to none "$build/bin/qtrain" "${qt_args[@]}" --log.metrics="$out/qtrain-moe.jsonl"
  ) >"$out/qtrain-moe.log" 2>&1 || echo "qtrain failed: see $out/qtrain-moe.log"
grep -E "^step|error|moe:" "$out/qtrain-moe.log" | tail -4
if [[ ${BASELINE:-1} != 0 ]]; then
  PYTHONPATH=bench/baselines${PYTHONPATH:+:$PYTHONPATH} python3 bench/baselines/hf_moe_train.py \
    --layers "$layers" --seq-len 4096 --batch 2 >"$out/torch-moe.json" 2>"$out/torch-moe.err" \
    || tail -5 "$out/torch-moe.err"
  cat "$out/torch-moe.json"
fi
python3 - "$out" "$layers" "${PEAK_TFLOPS:-989}" <<'PY'
import json, os, sys
out, L, peak = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]) * 1e12
H, Q, KV, E, k, Im, V, T = 2048, 32 * 128, 4 * 128, 128, 8, 768, 151936, 4096
# FLOPs a token, training (3 x the forward's 2 per multiply-add): the matrices it runs through
# (attention projections, router, k experts, lm head), and attention itself causal (halved).
per_layer = H * (Q + 2 * KV) + Q * H + E * H + k * 3 * H * Im
flops = 6 * (L * per_layer + V * H) + 3 * L * 2 * 2 * T * Q / 2
def tokens_per_s(path):
    steps = [json.loads(l) for l in open(path)] if os.path.exists(path) else []
    last = max((s["step"] for s in steps), default=0)
    steps = [s for s in steps if s["step"] > last // 2]  # the second half: past the warm-up and
                                                          # the first GEMM plans of each shape
    return sum(s["tokens_per_s"] for s in steps) / len(steps) if steps else None
qt = tokens_per_s(f"{out}/qtrain-moe.jsonl")
hf = None
if os.path.exists(f"{out}/torch-moe.json") and os.path.getsize(f"{out}/torch-moe.json") > 0:
    hf = json.loads(open(f"{out}/torch-moe.json").read().strip().splitlines()[-1])["tokens_per_s"]
for name, v in (("qtrain", qt), ("transformers", hf)):
    if v:
        print(f"{name:13s} {v:10.0f} tokens/s  {v * flops / 1e12:6.1f} TFLOP/s  MFU {v * flops / peak:.1%}")
if qt and hf:
    print(f"qtrain / transformers = {qt / hf:.3f}  ({flops / 1e9:.2f} GFLOP a token, {L} layers)")
PY
