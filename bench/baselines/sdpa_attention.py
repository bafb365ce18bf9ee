#!/usr/bin/env python3
"""PyTorch baseline for bench/bench_attention_cuda.cpp: F.scaled_dot_product_attention
(is_causal=True, enable_gqa=True, bf16) forward and forward+backward on the same shapes, timed with
CUDA events (median of the repeats). Tensors are [B, T, H, D] contiguous viewed as [B, H, T, D],
the layout transformers hands to SDPA and the one our kernels read.

Causal FLOPs as in the C++ benchmark: fwd = 4*B*nh*T^2*hd/2, fwd+bwd = 3.5*fwd.

  python3 bench/baselines/sdpa_attention.py [--ours bench_attention.json] [--json out.json]

With --ours (the C++ benchmark's --benchmark_out JSON) it prints our TFLOP/s next to SDPA's, for
both of our kernel paths (mma: mma.sync, 4 warps; wgmma: the sm_90a kernels), and the ratio
ours (wgmma, else mma) / SDPA default.
"""
import argparse
import json
import re
import statistics
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [(nh, nkv, T) for nh, nkv in ((16, 8), (32, 8)) for T in (1024, 4096, 8192)]
TOKENS, HD = 8192, 128
BACKENDS = {
    "default": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def fwd_flops(B, T, nh):
    return 4.0 * B * nh * T * T * HD / 2.0


def time_ms(fn, reps=20, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def run_shape(nh, nkv, T):
    B = TOKENS // T
    g = torch.Generator(device="cuda").manual_seed(1234)

    def rand(h):
        return torch.randn(B, T, h, HD, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)

    q, k, v, dout = rand(nh), rand(nkv), rand(nkv), rand(nh)
    q.requires_grad_(True)
    k.requires_grad_(True)
    v.requires_grad_(True)
    res = {}
    for name, backend in BACKENDS.items():
        def sdpa():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def fwd():
            with torch.no_grad():
                sdpa()

        def fwdbwd():
            out = sdpa()
            torch.autograd.grad(out, (q, k, v), dout)

        try:
            if backend is None:
                f_ms, fb_ms = time_ms(fwd), time_ms(fwdbwd)
            else:
                with sdpa_kernel(backend):
                    f_ms, fb_ms = time_ms(fwd), time_ms(fwdbwd)
            ff = fwd_flops(B, T, nh)
            res[name] = {"fwd_ms": f_ms, "fwdbwd_ms": fb_ms, "fwd_tflops": ff / f_ms / 1e9,
                         "fwdbwd_tflops": 3.5 * ff / fb_ms / 1e9}
        except RuntimeError as e:  # backend not available for these inputs
            res[name] = {"error": str(e).splitlines()[0][:100]}
    return B, res


def load_ours(path):
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        print(f"note: no results of ours to compare ({e})")
        return {}
    ours = {}
    for b in data.get("benchmarks", []):
        name = re.sub(r"/(min_time:[^/]*|manual_time)", "", b["name"])
        if "TFLOP/s" in b and not b.get("error_occurred", False):
            ours[name] = b["TFLOP/s"]
    return ours


def main():
    warnings.filterwarnings("ignore")  # SDPA explains at length why each backend declined
    ap = argparse.ArgumentParser()
    ap.add_argument("--ours", help="JSON written by qtrain_bench_attention_cuda --benchmark_out")
    ap.add_argument("--json", help="write SDPA results here")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name()}")
    print("causal FLOPs: fwd = 4*B*nh*T^2*hd/2; fwd+bwd = 3.5*fwd; TFLOP/s, median of 20")
    ours = load_ours(args.ours) if args.ours else {}
    all_res = {}
    hdr = f"{'shape':<24}{'kind':<8}" + "".join(f"{n:>11}" for n in BACKENDS)
    if ours:
        hdr += f"{'mma':>9}{'wgmma':>9}{'ours/def':>10}"
    print(hdr)
    for nh, nkv, T in SHAPES:
        B, res = run_shape(nh, nkv, T)
        key = f"nh{nh}_nkv{nkv}/T{T}_B{B}"
        all_res[key] = res
        for kind, mma_name in (("fwd", f"fwd/{key}/mma_w4"), ("fwdbwd", f"fwdbwd/{key}/mma")):
            cells = []
            for n in BACKENDS:
                r = res[n]
                cells.append(f"{r[kind + '_tflops']:>11.1f}" if "error" not in r else f"{'n/a':>11}")
            line = f"{key:<24}{kind:<8}" + "".join(cells)
            if ours:
                mma = ours.get(mma_name)
                wg = ours.get(f"{kind}/{key}/wgmma")  # the default wgmma block shapes
                base = res["default"].get(kind + "_tflops")
                fmt = lambda x: f"{x:>9.1f}" if x else f"{'n/a':>9}"
                ratio = lambda x: f"{x / base:>10.2f}" if x and base else f"{'n/a':>10}"
                line += fmt(mma) + fmt(wg) + ratio(wg or mma)
            print(line, flush=True)
    for key, res in all_res.items():
        for n, r in res.items():
            if "error" in r:
                print(f"note: {key} {n}: {r['error']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_res, f, indent=1)


if __name__ == "__main__":
    main()
