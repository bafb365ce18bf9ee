#!/usr/bin/env python3
"""Scaling study of dense Qwen3-8B (issue 21): weak and strong scaling on 1, 2, 4 and 8 GPUs of one
host, with each layout family, written to a CSV beside `qtrain plan`'s predictions.

  python3 bench/scaling/scaling.py BUILD OUT [--gpus 1,2,4,8] [--families ...] [--dry-run]
                                   [--extra="--key=value ..."] [--tag NAME]

--extra adds deck overrides to every run of the call (the slice too), --tag NAME appends "-NAME"
to the runs' names: variants of one layout side by side in one CSV, e.g.
--extra="--optim.grad_reduce=bf16" --tag bf16 (environment variables such as NCCL_MAX_CTAS pass through).

Every run: the whole Qwen3-8B (36 layers, untied), seq 4096, one sequence a micro-batch, synthetic
tokens, no checkpoints, --steps steps (default 8; tokens/s and collective times are the means of
the steps after the first two). Weak scaling keeps --per-gpu sequences a GPU a step (default 4,
global batch = 4 N); strong scaling keeps the global batch at --strong-global (default 16).

  family   layout on N GPUs                                              batch
  slice    1 GPU: the first 12 of Qwen3-8B's layers (the whole model does   weak
           not fit one GPU): the reference that weak-scaling efficiency is
           measured against (MFU(N) / MFU(slice))
  zero3    dp N, optim.zero_stage 3                                       weak
  strong   dp N, optim.zero_stage 3                                       strong (skipped where
                                                                          it equals zero3's)
  tp       tp N (dp 1), sequence parallelism on, ZeRO-0                   weak
  pp       pp N (dp 1), ZB-H1, interleaved over 2 chunks a stage (3 where   weak
           2 do not divide the layers evenly)
  plan     the layout `qtrain plan` recommends for N GPUs of this memory  weak

A run whose layout does not fit the GPUs without recompute (the planner's memory model says so)
runs with train.recompute = true (a pipeline then with 1F1B: ZB-H1 keeps activations), and the
CSV says so. Sources the runtime kit (.kit/kit-env.sh, docs/cuda.md) when there is one, unless
--no-kit; runs GPU counts up to what nvidia-smi shows. Writes OUT/scaling.csv (one row a
run; bench/scaling/plot.py draws it) and each run's log and metrics under OUT/runs/.
"""
import argparse
import json
import os
import re
import shlex
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from summarize_throughput import flops_per_token  # noqa: E402

MODEL, LAYERS, SEQ = "qwen3-8b", 36, 4096
BASE = ["inputs/qwen3-0.6b.ini", f"--model.preset={MODEL}", "--train.device=cuda",
        f"--train.seq_len={SEQ}", "--train.micro_batch=1", "--data.source=synthetic",
        "--checkpoint.every=-1", "--checkpoint.resume=none", "--log.every=1",
        "--optim.warmup_steps=2"]
FAMILIES = ["slice", "zero3", "strong", "tp", "pp", "plan"]
COLUMNS = ["run", "family", "gpus", "dp", "tp", "pp", "zero", "recompute", "schedule",
           "global_batch", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "efficiency",
           "peak_gib", "step_s", "comm_ms", "predicted_step_s", "predicted_peak_gib",
           "predicted_tokens_per_s_per_gpu", "device", "status"]


def layouts(n, args):
    """The runs of N GPUs: (name, family, spec, keys {deck key: value}, global batch)."""
    weak = args.per_gpu * n
    out = []
    if n == 1:
        out.append(("slice-np1", "slice", f"{MODEL}:12", {"model.num_layers": 12}, weak))
        return out
    out.append((f"zero3-np{n}", "zero3", MODEL, {"mesh.dp": n, "optim.zero_stage": 3}, weak))
    if args.strong_global != weak:
        out.append((f"strong-np{n}", "strong", MODEL, {"mesh.dp": n, "optim.zero_stage": 3},
                    args.strong_global))
    out.append((f"tp-np{n}", "tp", MODEL, {"mesh.dp": 1, "mesh.tp": n,
                                           "mesh.sequence_parallel": "true",
                                           "optim.zero_stage": 0}, weak))
    if LAYERS % n == 0 and n <= 4:
        chunks = next(c for c in (2, 3, 1) if LAYERS % (c * n) == 0)
        out.append((f"pp-np{n}", "pp", MODEL, {"mesh.dp": 1, "mesh.pp": n,
                                               "mesh.pp_schedule": "zb-h1",
                                               "mesh.pp_chunks": chunks,
                                               "optim.zero_stage": 0}, weak))
    out.append((f"plan-np{n}", "plan", MODEL, None, weak))
    return out


def with_kit(line, args):
    """The command with the runtime kit's environment when there is one (.kit, docs/cuda.md)."""
    use = not args.no_kit and os.path.exists(".kit/kit-env.sh")
    return f"source .kit/kit-env.sh && {line}" if use else line


def plan(args, n, glob, keys):
    """`qtrain plan` for N GPUs: its recommended deck keys and, per layout row, the prediction."""
    micro = args.extra_keys.get("train.micro_batch", "1")
    cmd = [os.path.join(args.build, "bin", "qtrain"), "plan", *BASE[:2], "--gpus", str(n),
           "--gpu-mem", str(args.gpu_mem), f"--train.seq_len={SEQ}", f"--train.micro_batch={micro}",
           f"--train.global_batch={glob}", "--sequence-parallel"]
    for k in ("mesh.pp_schedule", "mesh.pp_chunks", "model.num_layers"):
        if keys and k in keys:
            cmd.append(f"--{k}={keys[k]}")
    line = " ".join(shlex.quote(c) for c in cmd)
    text = subprocess.run(["bash", "-c", with_kit(line, args)],
                          capture_output=True, text=True, check=False).stdout
    rows = {}
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 19 and f[0].isdigit() and f[12] in ("yes", "no"):
            rows[(int(f[0]), int(f[1]), int(f[2]), int(f[3]), f[4], f[5] == "yes")] = {
                "peak": float(f[11]), "fits": f[12] == "yes", "step_s": float(f[13]),
                "tokens_per_s_per_gpu": float(f[14])}
    rec = re.search(r"deck keys: (.*)", text)
    recommended = {}
    if rec:
        for kv in rec.group(1).split():
            k, _, v = kv[2:].partition("=")
            recommended[k] = v
    return rows, recommended


def row_key(keys):
    return (int(keys.get("mesh.dp", 1)), int(keys.get("mesh.tp", 1)), int(keys.get("mesh.pp", 1)),
            int(keys.get("optim.zero_stage", 0)), keys.get("optim.offload", "none"),
            str(keys.get("train.recompute", "false")) == "true")


def summarize(jsonl, n, spec, peak_tflops):
    """tokens/s per GPU, TFLOP/s per GPU, MFU, arena peak GiB, step s and collective ms a step
    (the means over the steps after the first two) from a run's metrics."""
    with open(jsonl) as f:
        steps = [json.loads(line) for line in f]
    late = [s for s in steps if s["step"] > 2] or steps[-1:]
    tps = sum(s["tokens_per_s"] for s in late) / len(late) / n
    tflops = tps * flops_per_token(spec, SEQ) / 1e12
    peak = float("nan")
    units = {"B": 2**-30, "KiB": 2**-20, "MiB": 2**-10, "GiB": 1.0, "TiB": 1024.0}
    for s in reversed(steps):
        m = re.search(r"([0-9.]+) (B|KiB|MiB|GiB|TiB) peak", s.get("memory", ""))
        if m:
            peak = float(m.group(1)) * units[m.group(2)]
            break
    comm = {}
    for s in late:
        for name, c in s.get("comm", {}).items():
            if not name.startswith("mpi."):
                comm[name] = comm.get(name, 0) + c["ms"] / len(late)
    step_s = sum(s["time_data_s"] + s["time_compute_s"] + s["time_optimizer_s"]
                 for s in late) / len(late)
    return {"tokens_per_s_per_gpu": tps, "tflops_per_gpu": tflops, "mfu": tflops / peak_tflops,
            "peak_gib": peak, "step_s": step_s, "comm": comm}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("build")
    p.add_argument("out")
    p.add_argument("--gpus", default="1,2,4,8")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--gpu-mem", type=float, default=0, help="GiB a GPU (default: nvidia-smi's)")
    p.add_argument("--per-gpu", type=int, default=4)
    p.add_argument("--strong-global", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--peak", type=float, default=989.0, help="TFLOP/s of one GPU, bf16 dense")
    p.add_argument("--no-kit", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="print the runs, launch nothing")
    p.add_argument("--extra", default="", help="deck overrides added to every run")
    p.add_argument("--tag", default="", help="suffix of the runs' names")
    args = p.parse_args()
    # --extra's keys replace the same keys of BASE and of a layout (a key given twice is an error)
    args.extra_keys = dict(kv[2:].split("=", 1) for kv in shlex.split(args.extra))
    device, visible = "unknown", 0
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True).stdout.strip().splitlines()
        device, visible = smi[0].split(",")[0].strip(), len(smi)
        if not args.gpu_mem:
            args.gpu_mem = round(float(smi[0].split(",")[1].split()[0]) / 1024)
    except (OSError, subprocess.CalledProcessError, IndexError, ValueError):
        if not args.gpu_mem:
            args.gpu_mem = 80
    families = args.families.split(",")
    os.makedirs(os.path.join(args.out, "runs"), exist_ok=True)
    csv_path = os.path.join(args.out, "scaling.csv")
    slice_mfu = None  # the 1-GPU reference, from this call or an earlier one into OUT
    lines = []
    if os.path.exists(csv_path):
        with open(csv_path) as f:
            lines = f.readlines()
    for line in lines[1:]:
        cells = line.split(",")
        if cells[1] == "slice" and cells[COLUMNS.index("status")] == "ok":
            slice_mfu = float(cells[COLUMNS.index("mfu")])
    csv = open(csv_path, "a")
    if not lines:
        csv.write(",".join(COLUMNS) + ",comm_detail\n")
    for n in (int(g) for g in args.gpus.split(",")):
        for name, family, spec, keys, glob in layouts(n, args):
            if family not in families:
                continue
            if args.tag:
                name = f"{name}-{args.tag}"
            if family == "plan":
                _, keys = plan(args, n, glob, None)
                if not keys:
                    print(f"{name}: qtrain plan recommends nothing for {n} GPUs", flush=True)
                    continue
            keys = dict(keys)
            rows, _ = plan(args, n, glob, keys)
            pred = rows.get(row_key(keys))
            if pred is None or not pred["fits"]:
                keys["train.recompute"] = "true"
                pred = rows.get(row_key(keys))
            keys.setdefault("train.recompute", "false")
            if keys["train.recompute"] == "true" and keys.get("mesh.pp_schedule") == "zb-h1":
                keys["mesh.pp_schedule"] = "1f1b"  # ZB-H1 keeps activations: not with recompute
            base = [b for b in BASE if b[2:].split("=", 1)[0] not in args.extra_keys]
            cmd = ["mpirun", "-np", str(n), "--bind-to", "none",
                   os.path.join(args.build, "bin", "qtrain"), *base, f"--train.global_batch={glob}",
                   f"--train.steps={args.steps}",
                   f"--log.metrics={os.path.join(args.out, 'runs', name + '.jsonl')}",
                   *(f"--{k}={v}" for k, v in keys.items() if k not in args.extra_keys),
                   *(f"--{k}={v}" for k, v in args.extra_keys.items())]
            line = " ".join(shlex.quote(c) for c in cmd)
            print(f"{name}: {line}", flush=True)
            if args.dry_run:
                continue
            status = "ok"
            if n > visible:
                status = f"not run: {visible} GPUs here"
            else:
                env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                           CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(n)))
                jsonl = os.path.join(args.out, "runs", name + ".jsonl")
                if os.path.exists(jsonl):
                    os.remove(jsonl)
                shell = with_kit(line, args)
                with open(os.path.join(args.out, "runs", name + ".log"), "w") as log:
                    rc = subprocess.run(["bash", "-c", shell], stdout=log, stderr=subprocess.STDOUT,
                                        env=env, check=False).returncode
                if rc != 0 or not os.path.exists(jsonl):
                    status = f"failed (exit {rc}): runs/{name}.log"
            r = {}
            if status == "ok":
                r = summarize(os.path.join(args.out, "runs", name + ".jsonl"), n, spec, args.peak)
                if family == "slice":
                    slice_mfu = r["mfu"]
                r["efficiency"] = r["mfu"] / slice_mfu if slice_mfu else float("nan")
            schedule = (f"{keys['mesh.pp_schedule']}x{keys.get('mesh.pp_chunks', 1)}"
                        if int(keys.get("mesh.pp", 1)) > 1 else "")
            vals = {"run": name, "family": family, "gpus": n, "dp": keys.get("mesh.dp", 1),
                    "tp": keys.get("mesh.tp", 1), "pp": keys.get("mesh.pp", 1),
                    "zero": keys.get("optim.zero_stage", 0),
                    "recompute": keys["train.recompute"], "schedule": schedule,
                    "global_batch": glob, "comm_ms": sum(r.get("comm", {}).values()),
                    "predicted_step_s": pred["step_s"] if pred else "",
                    "predicted_peak_gib": pred["peak"] if pred else "",
                    "predicted_tokens_per_s_per_gpu": pred["tokens_per_s_per_gpu"] if pred else "",
                    "device": device, "status": status, **r}
            detail = ";".join(f"{k}={v:.2f}" for k, v in sorted(r.get("comm", {}).items()))
            cells = [vals.get(c, "") for c in COLUMNS]
            csv.write(",".join(f"{c:.4g}" if isinstance(c, float) else str(c) for c in cells)
                      + f",{detail}\n")
            csv.flush()
            if r:
                print(f"  {r['tokens_per_s_per_gpu']:.0f} tokens/s per GPU, MFU "
                      f"{100 * r['mfu']:.1f}%, peak {r['peak_gib']:.1f} GiB, collectives "
                      f"{vals['comm_ms']:.0f} ms a step ({detail})", flush=True)
            else:
                print(f"  {status}", flush=True)


if __name__ == "__main__":
    main()
