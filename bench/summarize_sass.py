#!/usr/bin/env python3
"""Instruction mix and stall reasons of kernels from Nsight Compute's source view.

usage: summarize_sass.py NCU_SOURCE_CSV [--top N]
  the CSV of `ncu --set full --import-source no --page source --print-source sass --csv ...`
  (bench/profile_attention.sh writes one)

Per profiled kernel launch: the instructions executed (warp level) and, by opcode, their share of
the instructions and of the warp-stall samples; the stall reasons; and, where the kernel has
wgmma (HGMMA), the instructions per HGMMA and the R2UR moves into uniform registers (descriptors
formed per thread and moved before each wgmma: docs/attention.md). --top N also lists the N
instructions with the most stall samples.
"""
import collections
import csv
import sys


def sections(lines):
    """Yields (kernel name, header, rows) per profiled launch."""
    kernel = "?"
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith('"Kernel Name"'):
            kernel = next(csv.reader([line]))[1]
        if line.startswith('"Address"'):
            end = i + 1
            while end < len(lines) and lines[end].startswith('"') and not (
                    lines[end].startswith('"Kernel Name"') or lines[end].startswith('"Address"')):
                end += 1
            rows = list(csv.reader(lines[i:end]))
            yield kernel, rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
            i = end
            continue
        i += 1


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(source: str) -> str:
    words = [w for w in source.split() if not w.startswith("@")]  # drop predicates
    return words[0].split(".")[0] if words else "?"


def summarize(kernel, header, rows, top):
    col = {name: n for n, name in enumerate(header)}
    executed = col["Instructions Executed"]
    samples = col["Warp Stall Sampling (All Samples)"]
    stall_cols = [n for n, name in enumerate(header) if name.startswith("stall_") and "Not Issued" not in name]
    total_exec = sum(number(r[executed]) for r in rows) or 1.0
    total_samples = sum(number(r[samples]) for r in rows) or 1.0
    by_op, samples_by_op, stalls = collections.Counter(), collections.Counter(), collections.Counter()
    for r in rows:
        op = opcode(r[col["Source"]])
        by_op[op] += number(r[executed])
        samples_by_op[op] += number(r[samples])
        for n in stall_cols:
            stalls[header[n]] += number(r[n])
    name = kernel.replace("void ", "")
    if name.endswith(")"):  # drop the argument list: from its matching "(" on
        depth = 0
        for k in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[k], 0)
            if depth == 0:
                name = name[:k]
                break
    print(f"== {name}")
    print(f"   {total_exec:.0f} warp instructions executed, {total_samples:.0f} stall samples")
    if by_op["HGMMA"]:
        print(f"   {total_exec / by_op['HGMMA']:.1f} instructions per HGMMA; "
              f"R2UR {by_op['R2UR'] / by_op['HGMMA']:.2f} per HGMMA")
    print(f"   {'opcode':12} {'instr':>6} {'stalls':>7}")
    for op, n in by_op.most_common(15):
        print(f"   {op:12} {100 * n / total_exec:5.1f}% {100 * samples_by_op[op] / total_samples:6.1f}%")
    print("   stall reasons: " + ", ".join(
        f"{k[len('stall_'):]} {100 * v / total_samples:.1f}%" for k, v in stalls.most_common(8)))
    if top:
        print(f"   the {top} instructions with the most stall samples:")
        hot = sorted(rows, key=lambda r: -number(r[samples]))[:top]
        for r in hot:
            print(f"   {number(r[samples]):7.0f} {r[col['Address']]:>6}  {r[col['Source']].strip()}")


def main() -> None:
    args = sys.argv[1:]
    top = 0
    if "--top" in args:
        k = args.index("--top")
        top = int(args[k + 1])
        del args[k:k + 2]
    if len(args) != 1:
        sys.exit(__doc__)
    lines = open(args[0], errors="replace").read().split("\n")
    seen = set()  # ncu may print a launch's view twice
    for kernel, header, rows in sections(lines):
        if "Instructions Executed" not in header:
            continue
        key = (kernel, len(rows), tuple(tuple(r) for r in rows[:8]))
        if key in seen:
            continue
        seen.add(key)
        summarize(kernel, header, rows, top)
    found = bool(seen)
    if not found:
        sys.exit("no source-view section found (was ncu run with --page source --csv?)")


if __name__ == "__main__":
    main()
