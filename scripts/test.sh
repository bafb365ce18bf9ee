#!/usr/bin/env bash
# The test suite: installs what is missing (Debian 12 / Ubuntu 24.04), builds the CPU back end,
# compiles and links the `cuda` preset when the CUDA toolkit is present, runs every CTest test of
# the CPU build, the parsers' tests under ASan + UBSan (the asan preset), then fuzzes the parsers
# (scripts/fuzz.sh). .ci/run calls this. Exits non-zero on any failure.
#
#   bash scripts/test.sh
#   QTRAIN_CTEST_ARGS="-L unit" bash scripts/test.sh      extra ctest arguments (labels: unit mpi deck slow gpu)
#   QTRAIN_SKIP_CUDA=1 bash scripts/test.sh               skip the CUDA build even where nvcc exists
#   QTRAIN_NVCC=/opt/cuda/bin/nvcc bash scripts/test.sh   where to look for nvcc
#   QTRAIN_CUDA_TARGETS="qtrain" bash scripts/test.sh     build only these targets of the cuda preset
#   QTRAIN_ASAN=all bash scripts/test.sh                  the whole suite under ASan + UBSan
#                                                         (default: the parsers' tests; 0: none)
#   QTRAIN_FUZZ_SECONDS=60 bash scripts/test.sh           seconds of fuzzing a parser (default 30)
#   QTRAIN_SKIP_FUZZ=1 bash scripts/test.sh               skip the fuzzing (scripts/fuzz.sh)
set -euo pipefail
# shellcheck source=scripts/common.sh
. "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# The tests also need shellcheck (tests/scripts: every script of scripts/ and the batch scripts'
# dry runs), matplotlib (tests/scripts: scripts/plot_metrics.py), and for the fuzzing of the
# parsers clang with its libFuzzer and sanitizer runtimes (scripts/fuzz.sh; Debian 12: clang 14).
QT_PACKAGES+=(shellcheck python3-matplotlib clang libclang-rt-dev)
qt_setup
cd "$QT_ROOT"

# The CUDA back end is compiled and linked only: its tests need a GPU, which CI does not have.
# CMakePresets.json names /usr/local/cuda/bin/nvcc for the cuda preset.
cuda_rc=0
nvcc=${QTRAIN_NVCC:-/usr/local/cuda/bin/nvcc}
if [ "${QTRAIN_SKIP_CUDA:-0}" = 1 ]; then
  qt_log "QTRAIN_SKIP_CUDA=1: skipping the cuda preset"
elif [ -x "$nvcc" ]; then
  qt_log "found $nvcc ($("$nvcc" --version | tail -n 1)); building the cuda preset (compile and link only)"
  extra=()
  [ "$nvcc" = /usr/local/cuda/bin/nvcc ] || extra=("-DCMAKE_CUDA_COMPILER=$nvcc")
  targets=()
  # shellcheck disable=SC2206  # QTRAIN_CUDA_TARGETS is a list of target names
  [ -z "${QTRAIN_CUDA_TARGETS:-}" ] || targets=(--target ${QTRAIN_CUDA_TARGETS})
  (
    cmake --preset cuda "${extra[@]}" &&
      cmake --build --preset cuda -j"$(qt_jobs)" "${targets[@]}"
  ) || cuda_rc=$?
  [ "$cuda_rc" -eq 0 ] || qt_log "FAILED: the cuda preset did not build (exit $cuda_rc); running the CPU tests anyway"
else
  qt_log "no CUDA toolkit at $nvcc: skipping the cuda preset (CPU back end only)"
fi

# --no-tests=error: a build that registered no test is a failure, not a silent pass.
ctest_args=(--preset cpu --output-on-failure --no-tests=error -j2)
# shellcheck disable=SC2206  # QTRAIN_CTEST_ARGS is a list of arguments
ctest_args+=(${QTRAIN_CTEST_ARGS:-})
qt_log "testing: ctest ${ctest_args[*]}"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
ctest_rc=0
ctest "${ctest_args[@]}" 2>&1 | tee "$log" || ctest_rc=${PIPESTATUS[0]}

# ctest's own summary: "97% tests passed, 1 tests failed out of 34".
summary=$(grep -E 'tests passed, [0-9]+ tests failed out of [0-9]+' "$log" | tail -n 1 || true)

# AddressSanitizer + UBSan (the `asan` preset, build-asan/, gcc, Debug) over the tests of the
# parsers of user files and the paths that refuse bad input: the deck (unit tests and the qtrain
# runs of bad decks), safetensors and config.json (Qwen3-VL's too), image files and the image
# processor's arithmetic, token files, the tokenizer, prep (records and the runs it refuses; not
# prep_mpi_np*, 2.4 min under ASan), checkpoints at 1 and 2 ranks, the synthetic source and the
# fuzz corpora's replays. The whole suite under ASan takes about 10 min
# to build and more than 14 min to run on CI's 2 cores (docs/fuzzing.md), past CI's budget:
# QTRAIN_ASAN=all runs it, QTRAIN_ASAN=0 skips this step. generate_out_of_memory_aborts cannot
# run under ASan (its `ulimit -v` leaves no room for the shadow memory). The tokenizer is the one
# the CPU tests fetched.
asan_targets=(qtrain qtrain_prep_driver test_deck qtrain_test_safetensors qtrain_test_hf_config
  qtrain_test_token_file qtrain_test_tokenizer_internals qtrain_test_tokenizer
  qtrain_test_prep_records qtrain_test_io qtrain_test_synthetic
  qtrain_fuzz_deck_replay qtrain_fuzz_safetensors_replay qtrain_fuzz_token_file_replay
  qtrain_fuzz_tokenizer_replay qtrain_fuzz_records_replay qtrain_fuzz_checkpoint_replay
  qtrain_fuzz_image_replay qtrain_test_vl_config qtrain_test_vision)
asan_tests='^(test_deck|qtrain_test_(safetensors|hf_config|vl_config|token_file|tokenizer_internals'
asan_tests+='|tokenizer|prep_records|synthetic))[.]|^(deck_|prep_|fuzz_replay_)'
asan_tests+='|^qtrain_test_vision[.](ImageFile|ImageResize|SmartResize|ImagePatches)[.]'
asan_tests+='|^(tokenizer_fetch_qwen3|io_checkpoint_np[12])$'
asan_tokenizer=${QTRAIN_TOKENIZER_DIR:-$QT_ROOT/build/tokenizers/qwen3}
asan_rc=0
case "${QTRAIN_ASAN:-parsers}" in
  0) qt_log "QTRAIN_ASAN=0: skipping the ASan + UBSan tests" ;;
  all)
    qt_log "ASan + UBSan: the whole suite (cmake --preset asan)"
    (
      cmake --preset asan -DQTRAIN_TOKENIZER_DIR="$asan_tokenizer" &&
        cmake --build --preset asan -j"$(qt_jobs)" &&
        ctest --preset asan --no-tests=error -j2 -E '^generate_out_of_memory_aborts$'
    ) || asan_rc=$?
    ;;
  *)
    qt_log "ASan + UBSan: the parsers' tests (cmake --preset asan; QTRAIN_ASAN=all runs everything)"
    (
      cmake --preset asan -DQTRAIN_TOKENIZER_DIR="$asan_tokenizer" &&
        cmake --build --preset asan -j"$(qt_jobs)" --target "${asan_targets[@]}" &&
        ctest --preset asan --no-tests=error -j2 -R "$asan_tests" -E '^prep_mpi_np'
    ) || asan_rc=$?
    ;;
esac

# The parsers of user files under libFuzzer with ASan and UBSan (docs/fuzzing.md): a clang build
# of the fuzz targets in build-fuzz/, then each target for QTRAIN_FUZZ_SECONDS, two at a time.
fuzz_rc=0
if [ "${QTRAIN_SKIP_FUZZ:-0}" = 1 ]; then
  qt_log "QTRAIN_SKIP_FUZZ=1: skipping the fuzzing"
else
  bash "$QT_ROOT/scripts/fuzz.sh" "${QTRAIN_FUZZ_SECONDS:-30}" || fuzz_rc=$?
fi

if [ "$cuda_rc" -ne 0 ]; then
  qt_log "FAILED: the cuda preset did not build (exit $cuda_rc)"
fi
if [ "$asan_rc" -ne 0 ]; then
  qt_log "FAILED: the ASan + UBSan tests (exit $asan_rc)"
fi
if [ "$fuzz_rc" -ne 0 ]; then
  qt_log "FAILED: scripts/fuzz.sh found a crash or did not build (exit $fuzz_rc)"
fi
if [ -n "$summary" ]; then
  failed=$(sed -E 's/.* ([0-9]+) tests failed out of ([0-9]+).*/\1/' <<<"$summary")
  total=$(sed -E 's/.* ([0-9]+) tests failed out of ([0-9]+).*/\2/' <<<"$summary")
  echo "ctest: $((total - failed)) passed, $failed failed"
else
  qt_log "FAILED: ctest printed no summary (exit $ctest_rc)"
  [ "$ctest_rc" -ne 0 ] || ctest_rc=1
fi
if [ "$ctest_rc" -ne 0 ] || [ "$cuda_rc" -ne 0 ] || [ "$asan_rc" -ne 0 ] ||
  [ "$fuzz_rc" -ne 0 ]; then
  exit 1
fi
