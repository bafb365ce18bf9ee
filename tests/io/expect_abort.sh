#!/bin/sh
# expect_abort.sh FILE REGEX COMMAND...
# Passes when COMMAND (an MPI job) fails with a non-zero exit code, without hanging, at least one
# line of its output (stdout and stderr) matches the extended regex REGEX, and neither FILE, nor
# FILE.tmp, nor FILE's directory (which must not exist before) exists afterwards: an internal
# check that stops the job before anything is written. (How many ranks printed before the abort
# ended the others cannot be relied on, so one matching line suffices; the count is shown.)
set -u
if [ $# -lt 3 ]; then
  echo "usage: expect_abort.sh FILE REGEX COMMAND..." >&2
  exit 64
fi
file=$1
regex=$2
shift 2
dir=$(dirname "$file")
rm -rf "$dir"
# shellcheck source=SCRIPTDIR/../support/capture.sh
. "$(dirname "$0")/../support/capture.sh"
capture "$@"
echo "---- exit code $rc"
if [ "$rc" -eq 0 ] || [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "FAIL: exit code $rc, expected a failure (not 0, not a timeout)"
  exit 1
fi
n=$(grep -cE -- "$regex" "$out")
if [ "$n" -lt 1 ]; then
  echo "FAIL: no line matches /$regex/"
  exit 1
fi
for f in "$file" "$file.tmp" "$dir"; do
  if [ -e "$f" ]; then
    echo "FAIL: $f exists: something was written"
    exit 1
  fi
done
echo "PASS: exit code $rc, $n rank(s) printed the message, nothing written"
