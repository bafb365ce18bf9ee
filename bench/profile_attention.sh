#!/usr/bin/env bash
# Instruction-level profile of the sm_90a attention kernels under Nsight Compute: the source view
# (SASS with executed instructions and warp-stall samples per instruction) of one launch each of
# the backward's dK/dV and dQ kernels and of the forward, at nh 16, nkv 8, T 4096, B 2, hd 128,
# summarised by bench/summarize_sass.py (instruction mix, stall reasons, instructions and R2UR
# per wgmma; docs/attention.md).
#   usage: bench/profile_attention.sh BUILD_DIR OUT_DIR
# Run on the GPU machine with the runtime kit in .kit (docs/cuda.md); takes about a minute.
set -uo pipefail
build=${1:?build dir}; out=${2:?output dir}
ncu=${NCU:-$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}
mkdir -p "$out"
( source .kit/kit-env.sh
  "$ncu" --set full --import-source no --page source --print-source sass --csv \
    -k regex:"attention_(dkdv|dq|forward)_sm90" -c 3 \
    "$build/bin/qtrain_bench_attention_cuda" --benchmark_filter='^fwdbwd/nh16_nkv8/T4096_B2/wgmma' \
) >"$out/ncu-attention-sass.csv" 2>"$out/ncu-attention-sass.err"
python3 "$(dirname "$0")/summarize_sass.py" "$out/ncu-attention-sass.csv" --top 5 | tee "$out/attention-sass.txt"
if command -v cuobjdump >/dev/null || [ -x /usr/local/cuda/bin/cuobjdump ]; then
  # Static counts from the library itself (no profiling): instructions, HGMMA and R2UR per kernel.
  "$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)" -sass "$build/lib/libqtrain_engine.so" \
    | awk '/Function : .*attention_(dkdv|dq|forward)_sm90_kernelILi128ELi2E/ {f = $3; next}
           /Function : / {f = ""}
           f != "" && /\/\*[0-9a-f]+\*\// {n[f]++; if (/HGMMA/) h[f]++; if (/R2UR/) r[f]++}
           END {for (k in n) printf "%8d instructions %4d HGMMA %4d R2UR  %s\n", n[k], h[k], r[k], k}' \
    | tee -a "$out/attention-sass.txt"
fi
