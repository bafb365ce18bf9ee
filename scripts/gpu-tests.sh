#!/usr/bin/env bash
# Runs every GPU test executable of a CUDA build without CTest (the GPU machine may lack CMake):
# build/bin/qtrain_gpu_<name> directly, qtrain_gpu_<name>_npN under mpirun -np N when the machine
# has N GPUs (skipped otherwise). Logs go to OUT_DIR/<name>.log; one summary line per test.
#   usage: scripts/gpu-tests.sh BUILD_DIR OUT_DIR [name ...]      (default: every test)
# With the runtime kit of docs/cuda.md: source .kit/kit-env.sh first. Exit status: the number of
# failed tests (0 = all passed).
set -u
build=${1:?build dir}; out=${2:?output dir}; shift 2
mkdir -p "$out"
export OMPI_ALLOW_RUN_AS_ROOT=${OMPI_ALLOW_RUN_AS_ROOT:-1} OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-1}
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1} GTEST_COLOR=no
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  for exe in "$build"/bin/qtrain_gpu_*; do names+=("${exe##*/qtrain_gpu_}"); done
fi
# A library the loader cannot find (a kit made without KIT_EXTRA, docs/cuda.md) fails every test
# the same way: say so once, before running anything.
missing=$(ldd "$build/bin/qtrain" "$build"/bin/qtrain_gpu_* 2>/dev/null | awk '/not found/ {print $1}' | sort -u | tr '\n' ' ')
if [ -n "$missing" ]; then
  echo "gpu-tests: the loader cannot find: $missing"
  echo "gpu-tests: make the kit with KIT_EXTRA=\"libbenchmark1debian libutf8proc2\" (docs/cuda.md);" \
       "on a warm machine rm -rf /opt/kit before sourcing .kit/kit-env.sh"
  exit 1
fi
failed=0
for name in "${names[@]}"; do
  exe=$build/bin/qtrain_gpu_$name
  [ -x "$exe" ] || { echo "MISSING $name ($exe)"; failed=$((failed + 1)); continue; }
  np=0
  [[ $name =~ _np([0-9]+)$ ]] && np=${BASH_REMATCH[1]}
  if [ "$np" -gt "$gpus" ]; then echo "SKIPPED $name (needs $np GPUs, found $gpus)"; continue; fi
  start=$SECONDS
  if [ "$np" -gt 0 ]; then
    timeout 900 mpirun -np "$np" --bind-to none "$exe" >"$out/$name.log" 2>&1
  else
    timeout 900 "$exe" >"$out/$name.log" 2>&1
  fi
  rc=$?
  counts=$(grep -E '^\[  (PASSED|FAILED|SKIPPED) +\] [0-9]+ tests?' "$out/$name.log" | tr -s ' ' | tr '\n' ' ')
  if [ $rc -eq 0 ]; then echo "ok      $name ($((SECONDS - start)) s) $counts"
  else echo "FAILED  $name (exit $rc, $((SECONDS - start)) s) $counts"; grep -E '^\[  FAILED  \]' "$out/$name.log" | head -10; failed=$((failed + 1)); fi
done
echo "$failed failed"
exit "$failed"
