# shellcheck shell=bash
# Helpers of the run-level shell tests (signals, locks, full disks); source it.
# Every test starts qtrain through "$mpiexec" -n 2 --oversubscribe and checks what it left.

fail() {
  echo "FAIL: $*"
  exit 1
}

# wait_lines FILE N [TENTHS]: waits until FILE has at least N lines (default at most 60 s).
wait_lines() {
  local file=$1 n=$2 tenths=${3:-600} i
  for ((i = 0; i < tenths; ++i)); do
    [[ -f "$file" && $(wc -l <"$file") -ge $n ]] && return 0
    sleep 0.1
  done
  fail "$file did not reach $n lines"
}

# ranks_of PID: the processes that the mpiexec of PID started on this host (its children).
ranks_of() {
  pgrep -P "$1" || true
}

# count_lines REGEX FILE: lines of FILE matching the extended REGEX.
count_lines() {
  grep -cE -- "$1" "$2" || true
}
