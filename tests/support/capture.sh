# shellcheck shell=sh
# Sourced by the test scripts that check a command's exit code and output (tests/deck/
# expect_exit.sh, tests/io/expect_abort.sh, tests/plan/plan_table.sh):
#   capture COMMAND...   runs COMMAND with stdout and stderr together into the file $out (removed
#                        on exit), cut off after 50 s (a hang), prints the output and sets $rc.
out=$(mktemp)
trap 'rm -f "$out"' EXIT
capture() {
  timeout -k 5 50 "$@" >"$out" 2>&1
  # shellcheck disable=SC2034 # rc is read by the sourcing script
  rc=$?
  cat "$out"
}
