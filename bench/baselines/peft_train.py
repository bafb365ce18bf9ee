#!/usr/bin/env python3
"""PEFT LoRA training baseline for qtrain's LoRA benchmark (same GPU, same run).

Qwen3 built from its config (random weights), bf16 base weights, SDPA attention; peft's LoRA with
r=8, lora_alpha=16, lora_dropout=0 on q/k/v/o_proj (peft's defaults otherwise: the adapters are
kept in fp32), fused AdamW over the adapters, `--batch` sequences of `--seq-len` synthetic tokens
per step, optionally with gradient checkpointing. Prints one JSON line like hf_train.py: tokens/s
over the timed steps (after warm-up), peak GPU memory.

  python3 bench/baselines/peft_train.py --model qwen3-0.6b --seq-len 4096 --batch 2
  python3 bench/baselines/peft_train.py --model qwen3-8b --batch 1 --grad-ckpt
"""
import argparse
import json

import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3ForCausalLM

from hf_train import add_common_args, qwen3_config, time_training  # same directory


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16)
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    ap.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing (non-reentrant)")
    a = ap.parse_args()
    cfg, layers = qwen3_config(a)
    torch.manual_seed(0)
    # Built on the GPU in bf16 (an 8B model initialised on the CPU in fp32 takes minutes).
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.config._attn_implementation = "sdpa"
    n_params = sum(p.numel() for p in model.parameters())
    if a.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lcfg = LoraConfig(r=a.r, lora_alpha=a.alpha, lora_dropout=0.0, bias="none",
                      target_modules=a.targets.split(","), task_type="CAUSAL_LM")
    model = get_peft_model(model, lcfg)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in trainable)
    opt = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0, fused=True)
    tokens_per_s, peak, loss = time_training(model, opt, a)
    print(json.dumps({"baseline": "peft", "mode": "eager", "model": a.model, "layers": layers,
                      "params": n_params, "trainable_params": n_trainable, "r": a.r,
                      "lora_alpha": a.alpha, "targets": a.targets, "grad_ckpt": a.grad_ckpt,
                      "seq_len": a.seq_len, "batch": a.batch, "tokens_per_s": tokens_per_s,
                      "peak_mem_gib": peak, "final_loss": loss, "gpu": torch.cuda.get_device_name(),
                      "peft_adapter_dtype": str(trainable[0].dtype)}))


if __name__ == "__main__":
    main()
