#!/usr/bin/env python3
"""Table of bench/train_throughput.sh's results: tokens/s, model TFLOP/s and MFU for qtrain and the
PyTorch baselines found in OUT_DIR.

  python3 bench/summarize_throughput.py OUT_DIR [--peak 989] [--seq-len 4096]

FLOPs per token = 6 N + 12 L H_q T, N = the parameters that take part in matrix products: every
decoder layer, the final norm and the lm head counted once (the input embedding table, a lookup, is
left out; a tied model's one matrix counts as the lm head). MFU is against --peak TFLOP/s
(989 = H100 SXM dense bf16). qtrain's tokens/s is the mean of the logged intervals after step 20.
LoRA runs (LORA=1 bench/train_throughput.sh: qtrain-lora-*.jsonl beside peft-*.json) get a table
of their own: tokens/s of qtrain and PEFT, their ratio, and peak GPU memory (qtrain: the arena's
peak, the step log's "memory" field; PEFT: torch.cuda.max_memory_allocated).
"""
import argparse
import glob
import json
import os
import re

PRESETS = {  # hidden, intermediate, layers, heads, kv heads (qwen3-spec.md 1.1); head_dim 128
    "qwen3-0.6b": (1024, 3072, 28, 16, 8),
    "qwen3-1.7b": (2048, 6144, 28, 16, 8),
    "qwen3-4b": (2560, 9728, 36, 32, 8),
    "qwen3-8b": (4096, 12288, 36, 32, 8),
    "qwen3-14b": (5120, 17408, 40, 40, 8),
    "qwen3-32b": (5120, 25600, 64, 64, 8),
}
VOCAB, HEAD_DIM = 151936, 128


def flops_per_token(spec, seq_len):
    name, _, layers = spec.partition(":")
    h, i, n_layers, nh, nkv = PRESETS[name]
    n_layers = int(layers) if layers else n_layers
    q, kv = nh * HEAD_DIM, nkv * HEAD_DIM
    layer = h * q + 2 * h * kv + q * h + 2 * HEAD_DIM + 2 * h + 3 * h * i
    n = n_layers * layer + h + VOCAB * h
    return 6 * n + 12 * n_layers * q * seq_len


def late_tokens_per_s(steps):
    late = [s["tokens_per_s"] for s in steps if s["step"] > 20] or [steps[-1]["tokens_per_s"]]
    return sum(late) / len(late)


def late_tokens_per_s_of(path):
    """late_tokens_per_s of a metrics file, None when it is missing or unreadable (a failed run)."""
    try:
        with open(path) as f:
            return late_tokens_per_s([json.loads(l) for l in f])
    except (OSError, ValueError, KeyError, IndexError):
        return None


def print_ab(label, runs):
    """The A/B scripts' summary: each side's runs (tokens/s, None for a failed run) and the mean of
    B over the mean of A."""
    for side in "ab":
        print(f"{label} {side.upper()}: " + ", ".join("failed" if t is None else f"{t:.0f}"
                                                       for t in runs[side]) + " tokens/s")
    ok = {side: [t for t in runs[side] if t is not None] for side in "ab"}
    if ok["a"] and ok["b"]:
        a, b = (sum(ok[s]) / len(ok[s]) for s in "ab")
        print(f"{label}: B / A = {b / a:.4f} ({100 * (b / a - 1):+.2f}%)")


# "GPU arena 12.3 GiB used, 14.5 GiB peak; ..." -> 14.5 (GiB)
def arena_peak_gib(steps):
    units = {"B": 2**-30, "KiB": 2**-20, "MiB": 2**-10, "GiB": 1.0, "TiB": 1024.0}
    for s in reversed(steps):
        m = re.search(r"([0-9.]+) (B|KiB|MiB|GiB|TiB) peak", s.get("memory", ""))
        if m:
            return float(m.group(1)) * units[m.group(2)]
    return float("nan")


def lora_table(out_dir):
    rows = []
    for path in sorted(glob.glob(os.path.join(out_dir, "qtrain-lora-*.jsonl"))):
        tag = os.path.basename(path)[len("qtrain-lora-"):-len(".jsonl")]
        steps = [json.loads(line) for line in open(path)]
        if not steps:
            continue
        peft_path = os.path.join(out_dir, f"peft-{tag}.json")
        peft = None
        if os.path.exists(peft_path) and os.path.getsize(peft_path) > 0:
            peft = json.load(open(peft_path))
        rows.append((tag, late_tokens_per_s(steps), arena_peak_gib(steps), peft))
    if not rows:
        return
    print("LoRA r=8 on q/k/v/o_proj, dropout 0 (qtrain vs PEFT, same GPU)")
    print(f"{'model':<14} {'batch':>5} {'qtrain tok/s':>12} {'PEFT tok/s':>10} {'qtrain/PEFT':>11} "
          f"{'qtrain peak':>11} {'PEFT peak':>9}")
    for tag, tps, peak, peft in rows:
        p_tps = peft["tokens_per_s"] if peft else float("nan")
        batch = f"{peft['batch']}{'+ckpt' if peft.get('grad_ckpt') else ''}" if peft else "?"
        p_peak = peft["peak_mem_gib"] if peft else float("nan")
        print(f"{tag:<14} {batch:>5} {tps:>12.0f} {p_tps:>10.0f} {tps / p_tps:>10.2f}x "
              f"{peak:>7.1f} GiB {p_peak:>5.1f} GiB")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--peak", type=float, default=989.0)
    ap.add_argument("--seq-len", type=int, default=4096)
    a = ap.parse_args()
    lora_table(a.out_dir)
    rows = []
    for path in sorted(glob.glob(os.path.join(a.out_dir, "qtrain-*.jsonl"))):
        tag = os.path.basename(path)[len("qtrain-"):-len(".jsonl")]
        if tag.startswith("lora-"):
            continue
        steps = [json.loads(line) for line in open(path)]
        rows.append((tag, "qtrain", late_tokens_per_s(steps)))
        for mode in ("eager", "compile"):
            base = os.path.join(a.out_dir, f"torch-{mode}-{tag}.json")
            if os.path.exists(base) and os.path.getsize(base) > 0:
                rows.append((tag, "pytorch " + mode, json.load(open(base))["tokens_per_s"]))
    ceiling = os.path.join(a.out_dir, "gemm-ceiling.log")
    if os.path.exists(ceiling):
        for line in open(ceiling):
            if line.startswith("measured cuBLAS ceiling"):
                tuned = float(line.split(":")[1].split()[0])
                print(f"{line.strip()} = {100 * tuned / a.peak:.1f}% of the {a.peak:.0f} TFLOP/s peak")
    if not rows:
        return
    print(f"FLOPs per token = 6 N + 12 L H_q T (T = {a.seq_len}); MFU against {a.peak:.0f} TFLOP/s")
    print(f"{'model':<14} {'run':<16} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'qtrain/run':>10}")
    for tag, run, tps in rows:
        spec = tag.replace("-L", ":")
        tflops = tps * flops_per_token(spec, a.seq_len) / 1e12
        ours = next(t for g, r, t in rows if g == tag and r == "qtrain")
        print(f"{tag:<14} {run:<16} {tps:>10.0f} {tflops:>8.1f} {100 * tflops / a.peak:>5.1f}% "
              f"{ours / tps:>9.2f}x")


if __name__ == "__main__":
    main()
