#!/usr/bin/env python3
"""Table of bench/train_throughput.sh's results: tokens/s, model TFLOP/s and MFU for qtrain and the
PyTorch baselines found in OUT_DIR.

  python3 bench/summarize_throughput.py OUT_DIR [--peak 989] [--seq-len 4096]

FLOPs per token = 6 N + 12 L H_q T, N = the parameters that take part in matrix products: every
decoder layer, the final norm and the lm head counted once (the input embedding table, a lookup, is
left out; a tied model's one matrix counts as the lm head). MFU is against --peak TFLOP/s
(989 = H100 SXM dense bf16). qtrain's tokens/s is the mean of the logged intervals after step 20.
"""
import argparse
import glob
import json
import os

PRESETS = {  # hidden, intermediate, layers, heads, kv heads (qwen3-spec.md 1.1); head_dim 128
    "qwen3-0.6b": (1024, 3072, 28, 16, 8),
    "qwen3-1.7b": (2048, 6144, 28, 16, 8),
    "qwen3-4b": (2560, 9728, 36, 32, 8),
    "qwen3-8b": (4096, 12288, 36, 32, 8),
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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--peak", type=float, default=989.0)
    ap.add_argument("--seq-len", type=int, default=4096)
    a = ap.parse_args()
    rows = []
    for path in sorted(glob.glob(os.path.join(a.out_dir, "qtrain-*.jsonl"))):
        tag = os.path.basename(path)[len("qtrain-"):-len(".jsonl")]
        steps = [json.loads(line) for line in open(path)]
        late = [s["tokens_per_s"] for s in steps if s["step"] > 20] or [steps[-1]["tokens_per_s"]]
        rows.append((tag, "qtrain", sum(late) / len(late)))
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
