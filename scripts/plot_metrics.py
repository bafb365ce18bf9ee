#!/usr/bin/env python3
"""Training curves from qtrain's metrics file (log.metrics, JSON lines) to one PNG: the loss (and
the evaluation loss, `eval_loss`, on the lines that have it), the learning rate, the gradient
norm and the throughput (tokens/s) against the optimizer step.

  python3 scripts/plot_metrics.py METRICS.jsonl OUT.png [--title TEXT]

Needs matplotlib (Debian: python3-matplotlib). A resumed run appends to the same file; where a
step appears twice (a run resumed from an earlier checkpoint), the later line wins, as
TensorBoard replaces the points of a restarted run. docs/monitoring.md.
"""
import argparse
import json
import sys


def read_metrics(path):
    """One record a step, sorted by step: the step's last line of each kind (the step line, and
    with [eval] the "kind": "eval" and "samples" lines) merged; exits 2 on a file that is not
    JSON lines."""
    by_kind = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                by_kind[(int(rec["step"]), rec.get("kind", "step"))] = rec
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                sys.exit(f"plot_metrics: {path}:{n}: not a metrics line ({e})")
    by_step = {}
    for (step, _), rec in by_kind.items():
        by_step.setdefault(step, {}).update(rec)
    return [by_step[s] for s in sorted(by_step)]


def series(records, key):
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("metrics", help="metrics file (log.metrics)")
    ap.add_argument("out", help="PNG to write")
    ap.add_argument("--title", default=None, help="figure title (default: the metrics file)")
    args = ap.parse_args()
    try:
        records = read_metrics(args.metrics)
    except OSError as e:
        sys.exit(f"plot_metrics: {e}")
    if not records:
        sys.exit(f"plot_metrics: {args.metrics} has no metrics lines")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    panels = (
        (axes[0][0], [("loss", "train"), ("eval_loss", "eval")], "loss (nats)", False),
        (axes[0][1], [("lr", None)], "learning rate", False),
        (axes[1][0], [("grad_norm", None)], "gradient norm (before clipping)", True),
        (axes[1][1], [("tokens_per_s", None)], "tokens/s", False),
    )
    for ax, keys, label, log_y in panels:
        for key, name in keys:
            x, y = series(records, key)
            if x:
                ax.plot(x, y, marker="." if len(x) < 50 else None, label=name)
        ax.set_ylabel(label)
        if log_y and all(v > 0 for v in series(records, keys[0][0])[1]):
            ax.set_yscale("log")
        if len([k for k, _ in keys if series(records, k)[0]]) > 1:
            ax.legend()
        ax.grid(True, alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.suptitle(args.title or args.metrics)
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"plot_metrics: wrote {args.out} ({len(records)} steps, {records[0]['step']} to "
          f"{records[-1]['step']})")


if __name__ == "__main__":
    main()
