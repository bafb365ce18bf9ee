#!/usr/bin/env python3
"""Plots of bench/scaling/scaling.py's CSV: tokens/s per GPU and weak-scaling efficiency against
the GPU count, one line per layout family, and a Markdown table of every run.

  python3 bench/scaling/plot.py OUT/scaling.csv [OUT_DIR]

Writes OUT_DIR (default: the CSV's folder)/tokens_per_gpu.png and efficiency.png (needs
matplotlib; without it only the table) and prints the table. Efficiency = the run's MFU over the
1-GPU slice's (the whole model does not fit one GPU), as scaling.py computes it.
"""
import csv
import os
import sys


def main():
    path = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.dirname(os.path.abspath(path))
    rows = [r for r in csv.DictReader(open(path)) if r["status"] == "ok"]
    print("| run | GPUs | dp x tp x pp | ZeRO | recompute | global batch | tokens/s/GPU | MFU | "
          "efficiency | peak GiB | predicted peak GiB | step s | predicted step s | "
          "collectives ms/step |")
    print("|---" * 14 + "|")
    for r in rows:
        f = lambda k, fmt="{:.3g}": fmt.format(float(r[k])) if r[k] not in ("", "nan") else "-"
        print(f"| {r['run']} | {r['gpus']} | {r['dp']} x {r['tp']} x {r['pp']} "
              f"{r['schedule']} | {r['zero']} | {r['recompute']} | {r['global_batch']} | "
              f"{f('tokens_per_s_per_gpu', '{:.0f}')} | {f('mfu', '{:.1%}')} | "
              f"{f('efficiency', '{:.1%}')} | {f('peak_gib', '{:.1f}')} | "
              f"{f('predicted_peak_gib', '{:.1f}')} | {f('step_s', '{:.2f}')} | "
              f"{f('predicted_step_s', '{:.2f}')} | {f('comm_ms', '{:.0f}')} |")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots", file=sys.stderr)
        return
    families = sorted({r["family"] for r in rows if r["family"] != "slice"})
    for key, name, label in (("tokens_per_s_per_gpu", "tokens_per_gpu.png", "tokens/s per GPU"),
                             ("efficiency", "efficiency.png", "MFU / 1-GPU slice MFU")):
        fig, ax = plt.subplots(figsize=(6, 4))
        strong = {r["global_batch"] for r in rows if r["family"] == "strong"}
        for fam in families:
            # zero3's run at the strong global batch is the strong series' point there too
            pts = sorted((int(r["gpus"]), float(r[key])) for r in rows if r["family"] == fam or
                         (fam == "strong" and r["family"] == "zero3" and r["global_batch"] in strong))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=fam)
        ax.set_xlabel("GPUs")
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
        ax.set_title(f"Qwen3-8B, seq 4096 ({rows[0]['device'] if rows else ''})")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out, name), dpi=120)
        print(f"wrote {os.path.join(out, name)}")


if __name__ == "__main__":
    main()
