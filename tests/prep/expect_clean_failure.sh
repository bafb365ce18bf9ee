#!/bin/sh
# expect_clean_failure.sh FILE CODE REGEX COMMAND...
#   Passes when tests/deck/expect_exit.sh CODE REGEX COMMAND... passes (exit code CODE, exactly
#   one line matching REGEX, no hang) and neither FILE nor FILE.tmp exists afterwards: a failure
#   that stops the job with one message and leaves no partial file behind. (Whether every rank
#   exited with CODE cannot be seen: mpirun kills the other ranks once one exits non-zero.)
set -u
if [ $# -lt 4 ]; then
  echo "usage: expect_clean_failure.sh FILE CODE REGEX COMMAND..." >&2
  exit 64
fi
file=$1
code=$2
regex=$3
shift 3
rm -f "$file" "$file.tmp"
"$(dirname "$0")/../deck/expect_exit.sh" "$code" "$regex" "$@" || exit 1
for f in "$file" "$file.tmp"; do
  if [ -e "$f" ]; then
    echo "FAIL: $f was left behind"
    exit 1
  fi
done
echo "PASS: exit code $code, one message, nothing left behind"
