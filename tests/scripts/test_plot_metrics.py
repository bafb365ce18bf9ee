#!/usr/bin/env python3
"""scripts/plot_metrics.py on a small hand-written metrics file: a PNG of the expected size comes
out, a step logged twice counts once, and a file that is not JSON lines is refused. matplotlib
is required (scripts/test.sh installs python3-matplotlib).

  python3 tests/scripts/test_plot_metrics.py REPO
"""
import json
import os
import struct
import subprocess
import sys
import tempfile
import unittest

REPO = sys.argv[1]
SCRIPT = os.path.join(REPO, "scripts", "plot_metrics.py")


def run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True)


class PlotMetrics(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def write(self, name, lines):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        return path

    def test_png_of_a_resumed_run_with_eval(self):
        recs = [{"step": s, "loss": 5.0 / s, "lr": 1e-3 * min(1, s / 3), "grad_norm": 2.0 / s,
                 "tokens_per_s": 1000.0 + s, "elapsed_s": s, "eta_s": 10 - s, "tokens": 100 * s}
                for s in range(1, 9)]
        recs[3]["eval_loss"] = 1.5
        recs[7]["eval_loss"] = 1.2
        lines = [json.dumps(r) for r in recs]
        lines.insert(6, json.dumps(recs[4]))  # resumed from step 5's checkpoint: 5 again
        lines.insert(2, "")
        path = self.write("m.jsonl", lines)
        out = os.path.join(self.dir, "curves.png")
        r = run(path, out, "--title", "tiny")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("8 steps, 1 to 8", r.stdout)
        with open(out, "rb") as f:
            head = f.read(24)
        self.assertEqual(head[:8], b"\x89PNG\r\n\x1a\n")
        self.assertEqual(head[12:16], b"IHDR")
        self.assertEqual(struct.unpack(">II", head[16:24]), (1000, 700))  # 10 x 7 in at 100 dpi

    def test_eval_lines_join_their_step(self):
        # [eval] writes its own lines ("kind": "eval" / "samples") after the step's line.
        sys.path.insert(0, os.path.dirname(SCRIPT))
        import plot_metrics
        lines = [json.dumps({"step": s, "loss": 3.0 - 0.1 * s, "lr": 1e-3, "grad_norm": 1.0,
                             "tokens_per_s": 100.0}) for s in (1, 2, 3, 4)]
        lines.insert(2, json.dumps({"step": 2, "kind": "eval", "eval_loss": 2.5, "eval_ppl": 12.2}))
        lines.append(json.dumps({"step": 4, "kind": "eval", "eval_loss": 2.25}))
        lines.append(json.dumps({"step": 4, "kind": "samples", "samples": []}))
        recs = plot_metrics.read_metrics(self.write("e.jsonl", lines))
        self.assertEqual([r["step"] for r in recs], [1, 2, 3, 4])
        self.assertEqual([r.get("eval_loss") for r in recs], [None, 2.5, None, 2.25])
        self.assertAlmostEqual(recs[3]["loss"], 2.6)
        self.assertAlmostEqual(recs[1]["loss"], 2.8)
        r = run(os.path.join(self.dir, "e.jsonl"), os.path.join(self.dir, "e.png"))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("4 steps, 1 to 4", r.stdout)

    def test_refuses_what_is_not_metrics(self):
        out = os.path.join(self.dir, "x.png")
        r = run(self.write("bad.jsonl", ['{"step": 1, "loss": 2}', "step 2 | loss 1.9"]), out)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("bad.jsonl:2: not a metrics line", r.stderr)
        r = run(self.write("empty.jsonl", [""]), out)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("has no metrics lines", r.stderr)
        r = run(os.path.join(self.dir, "missing.jsonl"), out)
        self.assertNotEqual(r.returncode, 0)
        self.assertFalse(os.path.exists(out))


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1])
