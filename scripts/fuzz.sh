#!/usr/bin/env bash
# Fuzzes the parsers of user files (docs/fuzzing.md): configures a clang build with
# -DQTRAIN_FUZZ=ON in build-fuzz/ (libFuzzer, ASan, UBSan), builds the targets of tests/fuzz and
# runs each for SECONDS (default 60) on a copy of its seed corpus (tests/fuzz/corpus/<target>/ is
# never grown). Exits non-zero when a target crashed, hit a sanitizer, a broken invariant, a
# timeout or the memory limit, and prints where the input that did it was kept.
#
#   bash scripts/fuzz.sh [SECONDS] [TARGET...]      targets: deck safetensors token_file tokenizer
#                                                   records checkpoint image (default: all)
#   QTRAIN_FUZZ_JOBS=N        targets fuzzed at once (default 2)
#   QTRAIN_FUZZ_BUILD=DIR     the build directory (default build-fuzz)
#   QTRAIN_FUZZ_KEEP=1        keep the grown corpora (printed) instead of removing them
#   CC / CXX                  the compilers (default clang / clang++)
#   QTRAIN_SKIP_APT=1         do not check or install distribution packages (scripts/common.sh)
#
# A finding is kept as DIR/findings/<target>/crash-<sha1> (or timeout-, oom-, leak-); replay it
# with DIR/bin/qtrain_fuzz_<target> FILE. Once fixed, copy it to tests/fuzz/corpus/<target>/ as a
# regression input (the ctest fuzz_replay_<target> runs it in every build).
set -euo pipefail
# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

seconds=${1:-60}
[ "$#" -eq 0 ] || shift
case "$seconds" in
  '' | *[!0-9]* | 0) qt_die "SECONDS must be a whole number >= 1, got '$seconds' (libFuzzer reads 0 as no limit)" ;;
esac
all_targets=(deck safetensors token_file tokenizer records checkpoint image)
targets=("$@")
[ "${#targets[@]}" -gt 0 ] || targets=("${all_targets[@]}")
for t in "${targets[@]}"; do
  [ -d "$QT_ROOT/tests/fuzz/corpus/$t" ] ||
    qt_die "unknown fuzz target '$t' (known: ${all_targets[*]})"
done
jobs=${QTRAIN_FUZZ_JOBS:-2}
build=${QTRAIN_FUZZ_BUILD:-$QT_ROOT/build-fuzz}
cc=${CC:-clang}
cxx=${CXX:-clang++}
# The project's packages and clang with its libFuzzer and sanitizer runtimes (libclang-rt-dev).
QT_PACKAGES+=(clang libclang-rt-dev)
qt_install_packages || exit 1
command -v "$cxx" >/dev/null 2>&1 || qt_die "no $cxx: install clang and libclang-rt-dev"
qt_mpi_env

qt_log "configuring the fuzz build in $build ($cxx)"
mkdir -p "$build"
cmake -S "$QT_ROOT" -B "$build" -G Ninja -DQTRAIN_FUZZ=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER="$cc" -DCMAKE_CXX_COMPILER="$cxx" >"$build/configure.log" 2>&1 ||
  { cat "$build/configure.log"; qt_die "configuring the fuzz build failed"; }
qt_log "building the fuzz targets: cmake --build $build -j$(qt_jobs)"
cmake --build "$build" -j"$(qt_jobs)" --target qtrain_fuzz_all ||
  qt_die "building the fuzz targets failed"

# Leaks are not findings here (MPI and HDF5 keep memory until exit); a finding is a crash, a
# sanitizer report, an input slower than -timeout seconds or one past -rss_limit_mb.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}
work=$(mktemp -d "${TMPDIR:-/tmp}/qtrain-fuzz.XXXXXX")
[ "${QTRAIN_FUZZ_KEEP:-0}" = 1 ] || trap 'rm -rf "$work"' EXIT

# Runs one target; its exit status and log stay in $work/<target>.{rc,log}.
fuzz_one() {
  local t=$1 rc=0
  mkdir -p "$work/$t" "$work/$t.tmp" "$build/findings/$t"
  cp -r "$QT_ROOT/tests/fuzz/corpus/$t/." "$work/$t/"
  # The target's scratch files (a crashed process leaves them) go where the trap removes them.
  TMPDIR="$work/$t.tmp" "$build/bin/qtrain_fuzz_$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -malloc_limit_mb=1024 -detect_leaks=0 -print_final_stats=1 \
    -artifact_prefix="$build/findings/$t/" "$work/$t" >"$work/$t.log" 2>&1 || rc=$?
  echo "$rc" >"$work/$t.rc"
}

qt_log "fuzzing ${targets[*]} for ${seconds} s each, $jobs at a time"
running=0
for t in "${targets[@]}"; do
  if [ "$running" -ge "$jobs" ]; then
    wait -n || true
    running=$((running - 1))
  fi
  fuzz_one "$t" &
  running=$((running + 1))
done
wait

failed=()
for t in "${targets[@]}"; do
  rc=$(cat "$work/$t.rc" 2>/dev/null || echo 1)
  stats=$(grep -E '^stat::number_of_executed_units' "$work/$t.log" | awk '{print $2}' || true)
  if [ "$rc" -eq 0 ]; then
    qt_log "$t: ${stats:-?} runs, no finding"
    continue
  fi
  failed+=("$t")
  qt_log "FAILED: $t (exit $rc); the end of its log:"
  tail -n 40 "$work/$t.log" >&2
  artifact=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$work/$t.log" | tail -n 1)
  if [ -n "$artifact" ]; then
    qt_log "$t: the input is kept at $artifact; replay it with $build/bin/qtrain_fuzz_$t $artifact"
  fi
done
[ "${QTRAIN_FUZZ_KEEP:-0}" != 1 ] || qt_log "grown corpora kept in $work"
if [ "${#failed[@]}" -gt 0 ]; then
  qt_log "FAILED: fuzz findings in ${failed[*]}"
  exit 1
fi
qt_log "fuzzing: no finding in ${targets[*]}"
