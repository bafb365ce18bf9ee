#!/usr/bin/env python3
"""Reads a log.tensorboard directory with TensorBoard's own readers and prints its tags.

Not run by CTest (CI has no `tensorboard` package; tests/io/test_event_file.cpp and
tests/train/test_tensorboard_run.cpp read the files there with an independent C++ reader). Run it
where the `tensorboard` Python package is installed (the GPU machine has it):

  python3 tests/reference/tensorboard_check.py DIR [--loss-points N] [--text config/deck]

Two readers:
  - event_accumulator.EventAccumulator, the classic reader: its scalars (simple_value) and
    tensors, with the number of points and the step range of each tag;
  - plugin_event_accumulator.EventAccumulator, what `tensorboard --logdir` serves: the tags the
    scalars and text dashboards list (simple_value migrated to the scalars plugin by
    data_compat), and the text of each text tag as the text plugin decodes it.
Exits 1 when no scalar was read, when --loss-points is given and train/loss does not have that
many points, or when a --text tag is missing from the text dashboard.
"""
import argparse
import sys

from tensorboard.backend.event_processing import event_accumulator, plugin_event_accumulator
from tensorboard.util import tensor_util


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="the log.tensorboard directory")
    ap.add_argument("--loss-points", type=int, default=None,
                    help="expected number of train/loss points (the steps logged)")
    ap.add_argument("--text", action="append", default=[], help="a text tag that must be there")
    args = ap.parse_args()
    ok = True

    classic = event_accumulator.EventAccumulator(
        args.dir, size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0})
    classic.Reload()
    tags = classic.Tags()
    print(f"{args.dir}: classic EventAccumulator")
    for tag in sorted(tags.get("scalars", [])):
        pts = classic.Scalars(tag)
        print(f"  scalar {tag}: {len(pts)} points, steps {pts[0].step}..{pts[-1].step}, "
              f"last {pts[-1].value:.6g}")
    for tag in sorted(tags.get("tensors", [])):
        pts = classic.Tensors(tag)
        print(f"  tensor {tag}: {len(pts)} points, steps {[p.step for p in pts]}")
    if not tags.get("scalars"):
        print("FAIL: no scalars", file=sys.stderr)
        ok = False
    if args.loss_points is not None:
        n = len(classic.Scalars("train/loss")) if "train/loss" in tags.get("scalars", []) else 0
        if n != args.loss_points:
            print(f"FAIL: train/loss has {n} points, expected {args.loss_points}", file=sys.stderr)
            ok = False

    served = plugin_event_accumulator.EventAccumulator(args.dir, size_guidance={"tensors": 0})
    served.Reload()
    scalars = served.PluginTagToContent("scalars")
    text = served.PluginTagToContent("text")
    print(f"{args.dir}: as tensorboard --logdir serves it")
    print(f"  scalars dashboard: {len(scalars)} tags: {', '.join(sorted(scalars))}")
    print(f"  text dashboard: {len(text)} tags: {', '.join(sorted(text))}")
    for tag in sorted(text):
        for ev in served.Tensors(tag):
            value = tensor_util.make_ndarray(ev.tensor_proto)
            s = value.item() if value.ndim == 0 else value.ravel()[0]
            s = s.decode("utf-8") if isinstance(s, bytes) else str(s)
            first = s.strip("`\n").splitlines()[0] if s.strip("`\n") else ""
            print(f"  text {tag} at step {ev.step}: {len(s)} characters, first line: {first}")
    if len(scalars) != len(tags.get("scalars", [])):
        print("FAIL: the scalars dashboard lists other tags than the classic reader's scalars",
              file=sys.stderr)
        ok = False
    for tag in args.text:
        if tag not in text:
            print(f"FAIL: text tag {tag} is not in the text dashboard", file=sys.stderr)
            ok = False
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
