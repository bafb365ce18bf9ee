#!/usr/bin/env bash
# Generation speed of `qtrain generate --device cuda` next to transformers' generate
# (bench/baselines/hf_generate.py) on the same random-weight Qwen3 and the same prompt, measured in
# the same run on the same GPU: greedy, batch 1, NEW new tokens (default 256), end of sequence
# ignored by the baseline (random weights rarely draw it; qtrain's line says when it stopped).
#   usage: bench/generate_speed.sh BUILD_DIR OUT_DIR [MODEL ...]   (default: qwen3-0.6b)
#   PROMPT_WORDS=500 (the prompt: that many words of a fixed sentence), NEW=256,
#   TOKENIZER=build/tokenizers/qwen3 (Qwen3's tokenizer.json; scripts/get-tokenizer.sh),
#   MODELS_DIR=/tmp/qtrain-gen-models (the Hugging Face directories written by the baseline).
# Run it on the GPU machine from the repository root with the runtime kit in .kit (docs/cuda.md).
# Prints one table row per model and writes OUT_DIR/generate-speed.md.
set -uo pipefail
build=${1:?build dir}; out=${2:?output dir}; shift 2
models=("${@:-qwen3-0.6b}")
tok=${TOKENIZER:-build/tokenizers/qwen3}; new=${NEW:-256}; dir=${MODELS_DIR:-/tmp/qtrain-gen-models}
mkdir -p "$out" "$dir"
prompt=$out/prompt.txt
words=(The quick brown fox jumps over the lazy dog while a patient scholar reads old maps.)
for ((i = 0; i < ${PROMPT_WORDS:-500}; ++i)); do printf '%s ' "${words[i % ${#words[@]}]}"; done >"$prompt"
table=$out/generate-speed.md
{ echo "| model | GPU | prompt tokens | prefill tokens/s qtrain | transformers | ratio | decode tokens/s qtrain | transformers | ratio |"
  echo "|---|---|---|---|---|---|---|---|---|"; } >"$table"
for model in "${models[@]}"; do
  hf=$dir/$model
  python3 bench/baselines/hf_generate.py --model "$model" --save "$hf" --tokenizer "$tok" \
    --prompt-file "$prompt" --new-tokens "$new" >"$out/hf-$model.json" 2>"$out/hf-$model.err" \
    || { echo "transformers $model failed: see $out/hf-$model.err"; tail -3 "$out/hf-$model.err"; continue; }
  ( source .kit/kit-env.sh
    for run in 1 2 3; do
      "$build/bin/qtrain" generate "$hf" --tokenizer "$tok" --device cuda --prompt "$(cat "$prompt")" \
        --max-new-tokens "$new" >/dev/null || exit 1
    done ) 2>"$out/qtrain-$model.err" || { echo "qtrain $model failed: see $out/qtrain-$model.err"; tail -3 "$out/qtrain-$model.err"; continue; }
  # The median of the three runs' last stderr lines, next to the baseline's JSON.
  python3 - "$out/qtrain-$model.err" "$out/hf-$model.json" "$model" >>"$table" <<'EOF'
import json, re, statistics, sys
err, hf, model = sys.argv[1], json.load(open(sys.argv[2])), sys.argv[3]
runs = re.findall(r"new tokens, .*?; prefill (\d+) tokens in [\d.]+ s \(([\d.]+) tokens/s\), decode ([\d.]+) tokens/s",
                  open(err).read())
assert len(runs) == 3, f"expected 3 speed lines in {err}"
n = int(runs[0][0])
pre = statistics.median(float(r[1]) for r in runs)
dec = statistics.median(float(r[2]) for r in runs)
if n != hf["prompt_tokens"]:
    sys.exit(f"prompt lengths differ: qtrain {n}, transformers {hf['prompt_tokens']}")
print(f"| {model} | {hf['gpu']} | {n} | {pre:.0f} | {hf['prefill_tokens_per_s']:.0f} | "
      f"{pre / hf['prefill_tokens_per_s']:.2f}x | {dec:.1f} | {hf['decode_tokens_per_s']:.1f} | "
      f"{dec / hf['decode_tokens_per_s']:.2f}x |")
EOF
  tail -1 "$table"
done
cat "$table"
