#!/usr/bin/env bash
# Copies what the GPU machine runs from a CUDA build into DEST/bin and DEST/lib: qtrain,
# qtrain_hf_tool, every GPU test (qtrain_gpu_*), the CUDA benchmarks and libqtrain_engine.so,
# about 17 MB stripped. The whole build's bin/ also holds the CPU tests and, with the runtime kit (.kit)
# and the tracked tree, no longer fits the device tool's 64 MiB carry limit.
#   usage: scripts/device-bundle.sh BUILD_DIR DEST      e.g. scripts/device-bundle.sh build-cuda build-device
# Then carry [".kit", "DEST"] and use DEST wherever the scripts take a build directory
# (scripts/gpu-tests.sh DEST OUT, bench/train_throughput.sh DEST OUT ...). A DEST named build-*
# is git-ignored.
set -euo pipefail
build=${1:?build dir}; dest=${2:?destination}
shopt -s nullglob
gpu_tests=("$build"/bin/qtrain_gpu_*)
if [ ! -x "$build/bin/qtrain" ] || [ ! -f "$build/lib/libqtrain_engine.so" ] || [ ${#gpu_tests[@]} -eq 0 ]; then
  echo "device-bundle: $build is not a CUDA build (needs bin/qtrain, bin/qtrain_gpu_* and" \
       "lib/libqtrain_engine.so: cmake --preset cuda && cmake --build --preset cuda)" >&2
  exit 2
fi
rm -rf "$dest"
mkdir -p "$dest/bin" "$dest/lib"
cp "$build/bin/qtrain" "$build"/bin/qtrain_hf_tool "$build"/bin/qtrain_gpu_* "$build"/bin/qtrain_bench_*cuda* "$dest/bin/"
cp "$build/lib/libqtrain_engine.so" "$dest/lib/"
# Symbols are not needed there; stripped, the bundle and the kit fit the carry limit together.
if command -v strip >/dev/null 2>&1; then strip --strip-unneeded "$dest"/bin/* "$dest"/lib/*.so; fi
echo "device-bundle: $(find "$dest/bin" -mindepth 1 -maxdepth 1 | wc -l) programs and the engine library in $dest ($(du -sh "$dest" | cut -f1))"
