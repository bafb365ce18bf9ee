#!/usr/bin/env bash
# Expert parallelism's throughput on two GPUs (issue 18's "Two GPUs, ep=2" benchmark): the
# 4-layer slice of Qwen3-30B-A3B of bench/moe_slice.sh (128 experts of width 768, 8 a token,
# 2 x 4096 tokens a rank a step, synthetic tokens, ZeRO-1, no recompute, no load-balancing
# loss) on one GPU, at dp 2 (ep 1) and at ep 2 (dp 2: each rank 64 experts a layer, one host
# sync a sparse layer's forward). Prints each run's logged tokens/s (the second half's mean;
# the whole job's tokens); weak-scaling efficiency = ep 2's / (2 x one GPU's).
#   usage: bench/moe_ep_slice.sh BUILD_DIR OUT_DIR      STEPS=30: the steps of each run;
#   EXTRA="--model.moe_capacity_factor=1.25 ...": more qtrain options for every run;
#   RUNS="ep2": only those of the runs one, dp2 and ep2 (A/Bs of the exchange)
# Run it on a machine with two GPUs from the repository root, the runtime kit in .kit when
# there is one (docs/cuda.md). Results: docs/moe.md "Expert parallelism on the GPU".
set -uo pipefail
B=${1:?build dir}; out=${2:?output dir}
mkdir -p "$out"
[ -f .kit/kit-env.sh ] && source .kit/kit-env.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
args=(inputs/qwen3-0.6b.ini --model.preset=qwen3-30b-a3b --model.num_layers=4
  --model.router_aux_loss_coef=0 --train.device=cuda --train.seq_len=4096 --train.micro_batch=2
  --train.steps=${STEPS:-30} --train.recompute=false --data.source=synthetic
  --checkpoint.every=-1 --checkpoint.resume=none --log.every=5 --optim.warmup_steps=5
  --optim.lr=1e-4 --optim.min_lr=1e-4 --optim.weight_decay=0.1 --optim.zero_stage=1)
# shellcheck disable=SC2206  # EXTRA is a list of options
args+=(${EXTRA:-})
run() {  # name ranks extra...
  local name=$1 np=$2; shift 2
  timeout 100 mpirun -np $np --bind-to none $B/bin/qtrain "${args[@]}" "$@" \
    --log.metrics=$out/$name.jsonl > $out/$name.log 2>&1
  echo "$name rc=$?"
  grep -E "^step|error|peak memory|back end" $out/$name.log | tail -3 | cut -c1-300
}
runs=" ${RUNS:-one dp2 ep2} "
[[ $runs == *" one "* ]] && run one 1 --train.global_batch=2
[[ $runs == *" dp2 "* ]] && run dp2 2 --train.global_batch=4 --mesh.dp=2
[[ $runs == *" ep2 "* ]] && run ep2 2 --train.global_batch=4 --mesh.dp=2 --mesh.ep=2
python3 - $out <<'PY'
import json, os, sys
out = sys.argv[1]
for n in ("one", "dp2", "ep2"):
    p = f"{out}/{n}.jsonl"
    if not os.path.exists(p): continue
    s = [json.loads(l) for l in open(p)]
    last = max(x["step"] for x in s)
    s = [x for x in s if x["step"] > last // 2]
    print(n, "tokens/s (second half, as logged):", round(sum(x["tokens_per_s"] for x in s) / len(s)))
PY
