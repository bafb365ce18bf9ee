#!/usr/bin/env python3
"""PyTorch FSDP2 training baseline for qtrain's ZeRO-3 and offload benchmarks (same GPUs, same run).

Qwen3 built from its config (random weights, fp32 master parameters), fully_shard per decoder
layer and on the whole model, MixedPrecisionPolicy(bf16 compute, fp32 gradient reduction), fp32
AdamW (torch.optim.AdamW, foreach), SDPA attention, one process per GPU under torchrun.
--offload: CPUOffloadPolicy (parameters, gradients and optimizer state on the host, AdamW on the
CPU). --accum: micro-batches per optimizer step. Prints one JSON line from rank 0: tokens/s per GPU
over the timed steps, peak GPU memory.

  torchrun --nproc-per-node 2 bench/baselines/fsdp2_train.py --model qwen3-8b --seq-len 4096 --batch 1
  torchrun --nproc-per-node 1 bench/baselines/fsdp2_train.py --model qwen3-8b --offload --accum 8
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from transformers import Qwen3ForCausalLM

from hf_train import add_common_args, qwen3_config, time_training


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--offload", action="store_true", help="CPUOffloadPolicy")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--grad-ckpt", action="store_true", help="activation checkpointing")
    a = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    cfg, layers = qwen3_config(a)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    if a.grad_ckpt:
        model.gradient_checkpointing_enable()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    extra = {"offload_policy": CPUOffloadPolicy()} if a.offload else {}
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp, **extra)
    fully_shard(model, mp_policy=mp, **extra)
    model.to_empty(device="cpu" if a.offload else "cuda")
    with torch.no_grad():  # the initialisation transformers would give, on the shards
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, foreach=True)
    n_params = sum(p.numel() for p in model.parameters())  # DTensor numel: the global size
    tokens_per_gpu, peak, loss = time_training(model, opt, a, accum=a.accum)
    if rank == 0:
        print(json.dumps({"baseline": "pytorch-fsdp2" + ("-offload" if a.offload else ""),
                          "model": a.model, "layers": layers, "params": n_params,
                          "gpus": world, "seq_len": a.seq_len, "batch": a.batch, "accum": a.accum,
                          "tokens_per_s_per_gpu": tokens_per_gpu, "peak_mem_gib": peak,
                          "final_loss": loss, "gpu": torch.cuda.get_device_name()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
