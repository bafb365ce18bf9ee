#!/usr/bin/env bash
# Qwen3-8B (all 36 layers) full fine-tuning at seq 4096 with the sharded state (issue 16), next to
# PyTorch FSDP2 (bench/baselines/fsdp2_train.py) in the same call on the same GPUs:
#   zero3:   N GPUs, optim.zero_stage = 3, one sequence a GPU per step, no recompute
#   offload: 1 GPU, optim.zero_stage = 3 + optim.offload = cpu, a global batch of 16 x 4096
#            tokens (16 accumulation steps), no recompute; FSDP2 with CPUOffloadPolicy, 8 steps
#   tp:      N GPUs, mesh.tp = N (tensor parallelism, dp 1, optim.zero_stage = ZERO, default 0),
#            N sequences a step (the tokens of zero3's step), no recompute; no baseline of its own:
#            run zero3 in the same call to compare
#   pp:      N GPUs, mesh.pp = N (pipeline, dp 1), mesh.pp_chunks = CHUNKS (default 1: 1F1B),
#            GLOBAL sequences a step (default 8 micro-batches), no recompute; no baseline
# MODEL (default qwen3-8b) and LAYERS (default: all) run another preset or a slice of it with its
# real layer shapes (e.g. MODEL=qwen3-32b LAYERS=24: the Qwen3-32B slice of issue 17).
# Synthetic tokens, no checkpoints. Prints tokens/s per GPU, model TFLOP/s and MFU
# (bench/summarize_throughput.py's FLOP count, against PEAK TFLOP/s, default 989: H100/H200 bf16
# dense), the arena's peak and, for pp, the mean measured bubble (the step log's pipeline idle).
#   usage: bench/sharded_8b.sh BUILD_DIR OUT_DIR zero3|offload|tp|pp [N] [extra qtrain options...]
#   BASELINE=0: qtrain only; STEPS: qtrain steps (default 30 for zero3, 6 for offload); GLOBAL:
#   sequences a step (zero3 and tp: default N, one micro-batch of one sequence a GPU)
# Run it on the GPU machine from the repository root with the runtime kit in .kit (docs/cuda.md).
set -uo pipefail
build=${1:?build dir}; out=${2:?output dir}; mode=${3:?zero3, offload, tp or pp}; n=${4:-2}
shift $(( $# < 4 ? $# : 4 ))
[[ $mode == offload ]] && n=1
mkdir -p "$out"
if [[ $mode == zero3 ]]; then
  steps=${STEPS:-30}; micro=1; global=${GLOBAL:-$n}; extra=(--optim.zero_stage=3)
elif [[ $mode == tp ]]; then
  steps=${STEPS:-30}; micro=1; global=${GLOBAL:-$n}; extra=(--mesh.tp="$n" --optim.zero_stage="${ZERO:-0}")
  BASELINE=0
elif [[ $mode == pp ]]; then
  steps=${STEPS:-20}; micro=1; global=${GLOBAL:-8}
  extra=(--mesh.pp="$n" --mesh.pp_chunks="${CHUNKS:-1}" --optim.zero_stage=0)
  BASELINE=0
else
  steps=${STEPS:-6}; micro=1; global=16; extra=(--optim.zero_stage=3 --optim.offload=cpu)
fi
model=${MODEL:-qwen3-8b}; spec=$model
layers=(); [[ -n ${LAYERS:-} ]] && { layers=(--model.num_layers="$LAYERS"); spec=$model:$LAYERS; }
tag=${spec/:/-L}-$mode-np$n
[[ $spec != qwen3-8b ]] && BASELINE=0  # the FSDP2 baseline runs the whole Qwen3-8B only
( source .kit/kit-env.sh
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  mpirun -np "$n" --bind-to none "$build/bin/qtrain" inputs/qwen3-0.6b.ini --model.preset="$model" \
    --train.device=cuda --train.seq_len=4096 --train.micro_batch=$micro --train.global_batch=$global \
    --train.steps="$steps" --train.recompute=false --data.source=synthetic --checkpoint.every=-1 \
    --checkpoint.resume=none --log.every=1 --log.metrics="$out/$tag.jsonl" --optim.warmup_steps=2 \
    "${layers[@]}" "${extra[@]}" "$@" ) >"$out/$tag.log" 2>&1 || echo "qtrain $tag failed: see $out/$tag.log"
grep -E "^step|error|back end" "$out/$tag.log" | tail -4
if [[ ${BASELINE:-1} != 0 ]]; then
  if [[ $mode == zero3 ]]; then
    torchrun --nproc-per-node "$n" bench/baselines/fsdp2_train.py --model qwen3-8b --seq-len 4096 \
      --batch 1 --steps 20 --warmup 3 >"$out/fsdp2-$tag.json" 2>"$out/fsdp2-$tag.err"
  else
    torchrun --nproc-per-node 1 bench/baselines/fsdp2_train.py --model qwen3-8b --seq-len 4096 \
      --batch 1 --accum 8 --offload --steps 2 --warmup 1 >"$out/fsdp2-$tag.json" 2>"$out/fsdp2-$tag.err"
  fi
  cat "$out/fsdp2-$tag.json" || true
  tail -3 "$out/fsdp2-$tag.err"
fi
PYTHONPATH=bench python3 - "$out" "$tag" "$n" "${PEAK:-989}" "$spec" <<'PY'
import json, os, sys
from summarize_throughput import arena_peak_gib, flops_per_token
out, tag, n, peak, spec = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
fpt = flops_per_token(spec, 4096)
steps = [json.loads(l) for l in open(f"{out}/{tag}.jsonl")]
late = [s["tokens_per_s"] for s in steps[2:]] or [steps[-1]["tokens_per_s"]]
tps = sum(late) / len(late) / n
idle = [s["pipeline_idle"] for s in steps[2:] if "pipeline_idle" in s]
bubble = f", pipeline idle {100 * sum(idle) / len(idle):.1f}% (mean of steps 3+)" if idle else ""
print(f"qtrain {tag}: {tps:.0f} tokens/s per GPU, {tps * fpt / 1e12:.0f} TFLOP/s, "
      f"MFU {100 * tps * fpt / 1e12 / peak:.1f}%, arena peak {arena_peak_gib(steps):.1f} GiB{bubble}")
path = f"{out}/fsdp2-{tag}.json"
if os.path.exists(path) and os.path.getsize(path) > 0:
    b = json.load(open(path))
    t = b["tokens_per_s_per_gpu"]
    print(f"FSDP2 {tag}: {t:.0f} tokens/s per GPU, MFU {100 * t * fpt / 1e12 / peak:.1f}%, "
          f"peak {b['peak_mem_gib']:.1f} GiB; qtrain / FSDP2 = {tps / t:.2f}x")
PY
