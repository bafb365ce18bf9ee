#!/bin/sh
# expect_clean_failure.sh NP FILE CODE REGEX COMMAND...
#   COMMAND is an MPI launch of NP ranks, each running `expect_clean_failure.sh --rank PROGRAM...`
#   (which runs PROGRAM, prints "rank exit code N" and exits with N). Passes when tests/deck/expect_exit.sh CODE
#   REGEX COMMAND... passes (exit code CODE, exactly one line matching REGEX, no hang), every one
#   of the NP ranks exited with CODE, and neither FILE nor FILE.tmp exists afterwards: a failure
#   that stops every rank alike and leaves no partial file behind.
set -u
if [ "${1:-}" = "--rank" ]; then
  shift
  "$@"
  rc=$?
  echo "rank exit code $rc"
  exit "$rc"
fi
if [ $# -lt 5 ]; then
  echo "usage: expect_clean_failure.sh NP FILE CODE REGEX COMMAND..." >&2
  exit 64
fi
np=$1
file=$2
code=$3
regex=$4
shift 4
rm -f "$file" "$file.tmp"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$(dirname "$0")/../deck/expect_exit.sh" "$code" "$regex" "$@" >"$log" 2>&1
rc=$?
cat "$log"
[ "$rc" -eq 0 ] || exit 1
n=$(grep -c "^rank exit code $code\$" "$log")
if [ "$n" -ne "$np" ]; then
  echo "FAIL: $n of $np ranks exited with code $code"
  exit 1
fi
for f in "$file" "$file.tmp"; do
  if [ -e "$f" ]; then
    echo "FAIL: $f was left behind"
    exit 1
  fi
done
echo "PASS: every rank exited with $code, nothing left behind"
