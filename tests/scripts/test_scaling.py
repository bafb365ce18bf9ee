#!/usr/bin/env python3
"""bench/scaling: the runs each GPU count gets, the summary of a run's metrics (hand-made, with
known answers) and a dry run through `qtrain plan`.

  python3 tests/scripts/test_scaling.py REPO BUILD
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

REPO, BUILD = sys.argv[1], sys.argv[2]
sys.path.insert(0, os.path.join(REPO, "bench", "scaling"))
sys.path.insert(0, os.path.join(REPO, "bench"))
import scaling  # noqa: E402


class Args:
    per_gpu, strong_global = 4, 16


class Scaling(unittest.TestCase):
    def test_layouts_of_each_gpu_count(self):
        self.assertEqual([r[0] for r in scaling.layouts(1, Args)], ["slice-np1"])
        runs = {r[0]: r for r in scaling.layouts(2, Args)}
        self.assertEqual(sorted(runs), ["plan-np2", "pp-np2", "strong-np2", "tp-np2", "zero3-np2"])
        self.assertEqual(runs["zero3-np2"][4], 8)    # weak: 4 sequences a GPU
        self.assertEqual(runs["strong-np2"][4], 16)  # strong: the global batch
        self.assertEqual(runs["pp-np2"][3]["mesh.pp_chunks"], 2)
        four = {r[0]: r for r in scaling.layouts(4, Args)}
        self.assertNotIn("strong-np4", four)  # 4 x 4 = 16: the weak run is the strong one
        self.assertEqual(four["pp-np4"][3]["mesh.pp_chunks"], 3)  # 36 layers: not 2 x 4 chunks
        self.assertNotIn("pp-np8", {r[0] for r in scaling.layouts(8, Args)})

    def test_summary_of_a_run(self):
        steps = [{"step": s, "tokens_per_s": 100.0 if s <= 2 else 20000.0 + 2000 * (s - 3),
                  "memory": "GPU 0: 20.0 GiB in use, 30.5 GiB peak", "time_data_s": 0.1,
                  "time_compute_s": 1.5, "time_optimizer_s": 0.4,
                  "comm": {"dp.all_gather": {"ms": 10.0 * s}, "mpi.dp.all_reduce": {"ms": 99.0}}}
                 for s in (1, 2, 3, 4)]
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
            f.write("".join(json.dumps(s) + "\n" for s in steps))
        r = scaling.summarize(f.name, 2, "qwen3-8b", 1000.0)
        os.remove(f.name)
        self.assertAlmostEqual(r["tokens_per_s_per_gpu"], 10500.0)  # (20000 + 22000) / 2 / 2 GPUs
        fpt = 6 * 8190735360 - 6 * 151936 * 4096 + 12 * 36 * 4096 * 4096  # no input embedding
        self.assertAlmostEqual(r["tflops_per_gpu"], 10500.0 * fpt / 1e12, places=6)
        self.assertAlmostEqual(r["mfu"], r["tflops_per_gpu"] / 1000.0)
        self.assertAlmostEqual(r["peak_gib"], 30.5)
        self.assertAlmostEqual(r["step_s"], 2.0)
        self.assertEqual(r["comm"], {"dp.all_gather": 35.0})  # steps 3 and 4; MPI left out

    def test_dry_run_launches_nothing_and_writes_the_header(self):
        with tempfile.TemporaryDirectory() as out:
            p = subprocess.run([sys.executable, os.path.join(REPO, "bench/scaling/scaling.py"),
                                BUILD, out, "--gpus", "1,2", "--gpu-mem", "80", "--dry-run"],
                               cwd=REPO, capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            names = [line.split(":")[0] for line in p.stdout.splitlines() if ": mpirun" in line]
            self.assertEqual(names, ["slice-np1", "zero3-np2", "strong-np2", "tp-np2", "pp-np2",
                                     "plan-np2"])
            self.assertFalse(os.listdir(os.path.join(out, "runs")))
            with open(os.path.join(out, "scaling.csv")) as f:
                header = f.readline().strip().split(",")
            self.assertEqual(header[:3], ["run", "family", "gpus"])


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
