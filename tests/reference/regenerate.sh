#!/usr/bin/env bash
# Makes the qtrain checkpoints that make_fixtures.py turns into golden fixtures: tiny Qwen3 models
# covering tied and untied embeddings, GQA ratios 2 and 4, and head_dim 64 and 128. Each is
# trained for one step from a wide initialisation, so no weight is at its initial value.
# usage: tests/reference/regenerate.sh BUILD_DIR OUT_DIR
# then, on a machine with transformers and h5py:
#   python3 tests/reference/make_fixtures.py --out tests/reference/fixtures OUT_DIR/*.h5
set -euo pipefail
build=${1:?build dir}; out=${2:?output dir}
mkdir -p "$out"
deck=$(dirname "$0")/../../inputs/tiny.ini
make_one() {  # name tied heads kv head_dim
  local name=$1 dir; dir=$(mktemp -d)
  "$build/bin/qtrain" "$deck" --checkpoint.resume=none --checkpoint.dir="$dir" --log.metrics= \
    --model.vocab_size=128 --model.hidden_size=32 --model.intermediate_size=64 \
    --model.num_layers=2 --model.tie_word_embeddings="$2" --model.num_heads="$3" \
    --model.num_kv_heads="$4" --model.head_dim="$5" --model.initializer_range=0.2 \
    --model.rope_theta=10000 --train.steps=1 --train.seq_len=16 --train.micro_batch=2 \
    --train.global_batch=2 --optim.lr=0.02 --optim.warmup_steps=0 >/dev/null
  cp "$dir"/step_00000001.h5 "$out/$name.h5"
  rm -rf "$dir"
}
make_one tied_gqa2_hd64 true 4 2 64
make_one untied_gqa4_hd128 false 8 2 128
make_one tied_gqa4_hd128 true 4 1 128
make_one untied_gqa2_hd64 false 4 2 64
ls -l "$out"
