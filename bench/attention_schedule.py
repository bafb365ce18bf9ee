#!/usr/bin/env python3
"""Makespan of the causal attention kernels' grids on an H100 under two launch orders.

Model: each SM runs one block at a time (the wgmma kernels' defaults: two warpgroups, one block
per SM); a block's time is proportional to its tile steps; blocks start in linear order (x
fastest), each on the SM that frees first. Prints, per kernel, the ideal makespan (all work
spread evenly), the makespan of the grid (tile, head, batch) with the tile fastest (before
2026-11-25) and of (head, batch, tile) with the tile slowest (attn::tiles_last_grid), each as a
percentage of the ideal.

  python3 bench/attention_schedule.py [--sms 132] [--T 4096] [--B 2] [--nh 16] [--nkv 8]
"""
import argparse
import heapq


def makespan(durations, sms):
    free = [0.0] * sms
    for d in durations:
        heapq.heappush(free, heapq.heappop(free) + d)
    return max(free)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--nh", type=int, default=16)
    ap.add_argument("--nkv", type=int, default=8)
    a = ap.parse_args()
    ratio, tiles = a.nh // a.nkv, a.T // 128
    kernels = {  # tile index (0 = launched first) -> steps, and the heads the grid runs over
        # dK/dV: kv tile i of 128 rows walks the query tiles of 64 rows at or after it, per query head
        "dK/dV": (lambda i: ratio * (a.T - 128 * i) // 64, a.nkv),
        # dQ: query tile (longest first) of 128 rows walks kv tiles of 64 up to its diagonal
        "dQ": (lambda i: 2 * (tiles - i), a.nh),
        # forward: query tile (longest first) of 128 rows walks kv tiles of 128
        "forward": (lambda i: tiles - i, a.nh),
    }
    print(f"T {a.T}, B {a.B}, nh {a.nh}, nkv {a.nkv}, {a.sms} SMs, one block per SM")
    for name, (steps, heads) in kernels.items():
        tile_fastest = [steps(i) for _ in range(a.B * heads) for i in range(tiles)]
        tile_slowest = [steps(i) for i in range(tiles) for _ in range(a.B * heads)]
        ideal = sum(tile_fastest) / a.sms
        before, after = makespan(tile_fastest, a.sms), makespan(tile_slowest, a.sms)
        print(f"{name:8s} ideal {ideal:7.0f} steps; tile fastest {before:6.0f} ({100 * ideal / before:.1f}%), "
              f"tile slowest {after:6.0f} ({100 * ideal / after:.1f}%)")


if __name__ == "__main__":
    main()
