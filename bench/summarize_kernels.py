#!/usr/bin/env python3
"""Sums the GPU time of an `ncu --csv --page raw --metrics gpu__time_duration.sum` log by kernel.

usage: summarize_kernels.py NCU_CSV   (bench/profile_step.sh writes one)
Prints one line per kernel name (templates collapsed): total ms, share, launches, mean us; then
the same time by group (GEMMs, attention, AdamW, ...), the table of docs/performance.md.
"""
import collections
import csv
import re
import sys


def short_name(name: str) -> str:
    name = name.replace("(anonymous namespace)::", "").replace("<unnamed>::", "")
    name = re.sub(r"\(.*", "", name)          # drop the argument list
    name = re.sub(r"<.*>", "<>", name)        # collapse template arguments (after the name)
    return name.replace("void ", "").strip()


# Kernel groups of the summary, first match wins (a kernel matching none is "other").
GROUPS = [
    ("MoE experts' grouped GEMMs (ours)", r"grouped_gemm"),
    ("GEMMs (cuBLASLt)", r"nvjet|cublasLt|gemm|splitKreduce"),
    ("attention", r"attention"),
    ("MoE router, routing, gather/combine", r"moe_"),
    ("AdamW", r"adamw"),
    ("SwiGLU", r"swiglu"),
    ("RMSNorm (+ norm weight gradients)", r"rmsnorm|column_sum"),
    ("q/k-norm + RoPE", r"qk_norm_rope"),
    ("cross-entropy", r"cross_entropy|loss_sum"),
    ("gradient norm", r"sum_squares|sum_partials"),
    ("embedding", r"embedding|DeviceRadixSort"),
]


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if re.search(pattern, name):
            return group
    return "other"


def main() -> None:
    rows = [line for line in open(sys.argv[1], errors="replace") if line.startswith('"')]
    reader = csv.DictReader(rows)
    total = collections.Counter()
    count = collections.Counter()
    for r in reader:
        value = r.get("gpu__time_duration.sum", "")
        try:
            ns = float(value.replace(",", ""))
        except ValueError:
            continue                          # the units row
        name = short_name(r.get("Kernel Name", "?"))
        total[name] += ns
        count[name] += 1
    all_ns = sum(total.values())
    if all_ns == 0:
        sys.exit("no kernel times found (did ncu run? see the .err file next to the csv)")
    print(f"{'ms':>9} {'share':>6} {'launches':>8} {'mean us':>9}  kernel")
    for name, ns in total.most_common():
        print(f"{ns / 1e6:9.3f} {100 * ns / all_ns:5.1f}% {count[name]:8d} {ns / count[name] / 1e3:9.1f}  {name}")
    print(f"{all_ns / 1e6:9.3f} 100.0% {sum(count.values()):8d}            all kernels of the profiled step")
    groups = collections.Counter()
    for name, ns in total.items():
        groups[group_of(name)] += ns
    print(f"\n{'ms':>9} {'share':>6}  group")
    for group, ns in groups.most_common():
        print(f"{ns / 1e6:9.3f} {100 * ns / all_ns:5.1f}%  {group}")


if __name__ == "__main__":
    main()
