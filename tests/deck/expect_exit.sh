#!/bin/sh
# expect_exit.sh CODE REGEX COMMAND...
# Runs COMMAND (stdout and stderr together) and passes when it exits with exactly CODE and
# exactly one line of its output matches the extended regex REGEX (so an error printed by every
# rank, rather than by rank 0 only, fails). A hang is cut off after 50 s.
set -u
if [ $# -lt 3 ]; then
  echo "usage: expect_exit.sh CODE REGEX COMMAND..." >&2
  exit 64
fi
code=$1
regex=$2
shift 2
# shellcheck source=SCRIPTDIR/../support/capture.sh
. "$(dirname "$0")/../support/capture.sh"
capture "$@"
echo "---- exit code $rc (expected $code)"
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
  echo "FAIL: timed out (hang?)"
  exit 1
fi
if [ "$rc" -ne "$code" ]; then
  echo "FAIL: exit code $rc, expected $code"
  exit 1
fi
n=$(grep -cE -- "$regex" "$out")
if [ "$n" -ne 1 ]; then
  echo "FAIL: $n lines match /$regex/, expected exactly 1"
  exit 1
fi
echo "PASS"
