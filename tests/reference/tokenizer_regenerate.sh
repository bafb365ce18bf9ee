#!/usr/bin/env bash
# Regenerates fixtures/tokenizer_qwen3.json with the JavaScript reference (tokenizer_ref.mjs):
# fetches the Qwen3 tokenizer (scripts/get-tokenizer.sh) and installs @lenml/tokenizers and
# @huggingface/jinja with npm into SCRATCH (not the repository).
#   tests/reference/tokenizer_regenerate.sh [SCRATCH]      default SCRATCH: build/tokenizer-ref
# On a machine with transformers, tokenizer_ref.py checks the same fixture.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
scratch=${1:-$root/build/tokenizer-ref}
mkdir -p "$scratch"
tokdir=$("$root/scripts/get-tokenizer.sh")
if [ ! -d "$scratch/node_modules/@lenml/tokenizers" ] || [ ! -d "$scratch/node_modules/@huggingface/jinja" ]; then
  (cd "$scratch" && { [ -f package.json ] || npm init -y >/dev/null; } &&
    npm install --silent --no-audit --no-fund @lenml/tokenizers@3.7.2 @huggingface/jinja@0.5.1)
fi
node "$here/tokenizer_ref.mjs" "$tokdir" "$scratch" "$here/tokenizer_cases.json" \
  "$here/fixtures/tokenizer_qwen3.json"
