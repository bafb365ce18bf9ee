#!/usr/bin/env python3
"""Where a pipeline step's idle time goes, from QTRAIN_PIPELINE_TIMELINE's files.

usage: pipeline_timeline.py PREFIX [--skip N]

PREFIX.stage<s>.jsonl (written by the CUDA pipeline back end, one line a step: each action's op,
chunk, micro-batch and compute start and end in ms from the stage's step start). For each stage,
over the steps after the first N (default 2, warm-up): the mean compute time of each kind of
action (F, B, I, W), the stage's busy time, its span (step start to its last action's end) and its
idle time split into the wait before its first action, the gaps between actions, and the tail
after its last action up to the longest stage's span. The bubble is simulate()'s: 1 - the stages'
busy time / (P x the longest span); the clocks of the GPUs differ, so each stage's times are
from its own start (the stages start about together, after the last step's collectives).
"""
import argparse
import glob
import json
import statistics
import sys


def load(prefix):
    stages = {}
    for path in sorted(glob.glob(prefix + ".stage*.jsonl")):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                stages.setdefault(rec["stage"], {})[rec["step"]] = rec["actions"]
    if not stages:
        sys.exit(f"pipeline_timeline: no {prefix}.stage*.jsonl files")
    return stages


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prefix")
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps left out (default 2)")
    args = ap.parse_args()
    stages = load(args.prefix)
    P = len(stages)
    steps = sorted(set.intersection(*(set(v) for v in stages.values())))
    steps = [s for s in steps if s >= args.skip]
    if not steps:
        sys.exit("pipeline_timeline: no step after the warm-up is in every stage's file")
    bubbles = []
    per_stage = {s: {"busy": [], "span": [], "head": [], "gaps": [], "ops": {}} for s in stages}
    for step in steps:
        spans = {s: max(a[4] for a in stages[s][step]) for s in stages}
        longest = max(spans.values())
        busy_all = 0.0
        for s in stages:
            acts = sorted(stages[s][step], key=lambda a: a[3])
            busy = sum(a[4] - a[3] for a in acts)
            busy_all += busy
            st = per_stage[s]
            st["busy"].append(busy)
            st["span"].append(spans[s])
            st["head"].append(acts[0][3])
            st["gaps"].append(sum(max(0.0, b[3] - a[4]) for a, b in zip(acts, acts[1:])))
            for a in acts:
                st["ops"].setdefault(a[0], []).append(a[4] - a[3])
        bubbles.append(1 - busy_all / (P * longest))
    longest = statistics.mean(max(per_stage[s]["span"][i] for s in stages) for i in range(len(steps)))
    print(f"{P} stages, steps {steps[0]}..{steps[-1]} ({len(steps)}); longest span {longest:.2f} ms; "
          f"bubble {100 * statistics.mean(bubbles):.2f}% (simulate()'s definition)")
    print("stage   busy ms   span ms  head ms  gaps ms  tail ms  " +
          "  ".join(f"{op:>8}" for op in "FBIW"))
    for s in sorted(stages):
        st = per_stage[s]
        m = {k: statistics.mean(v) for k, v in st.items() if k != "ops"}
        tail = longest - m["span"]
        ops = "  ".join(f"{statistics.mean(st['ops'][op]):8.3f}" if op in st["ops"] else f"{'-':>8}"
                        for op in "FBIW")
        print(f"{s:5d} {m['busy']:9.2f} {m['span']:9.2f} {m['head']:8.2f} {m['gaps']:8.2f} "
              f"{tail:8.2f}  {ops}")
    print("head: before the first action; gaps: between actions (waiting for a receive); tail: "
          "after the last, up to the longest span. F/B/I/W: mean ms an action of each kind")


if __name__ == "__main__":
    main()
