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
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM

PRESETS = {  # hidden, intermediate, layers, heads, kv heads, tied (qwen3-spec.md 1.1)
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, True),
    "qwen3-1.7b": (2048, 6144, 28, 16, 8, True),
    "qwen3-4b": (2560, 9728, 36, 32, 8, True),
    "qwen3-8b": (4096, 12288, 36, 32, 8, False),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=0, help="override the layer count")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16)
    ap.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj")
    ap.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing (non-reentrant)")
    a = ap.parse_args()
    h, i, layers, nh, nkv, tied = PRESETS[a.model]
    layers = a.layers or layers
    cfg = Qwen3Config(vocab_size=151936, hidden_size=h, intermediate_size=i, num_hidden_layers=layers,
                      num_attention_heads=nh, num_key_value_heads=nkv, head_dim=128,
                      tie_word_embeddings=tied, max_position_embeddings=40960,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}, use_cache=False)
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
    ids = torch.randint(0, 151936, (a.batch, a.seq_len), device="cuda")

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens = a.batch * a.seq_len * a.steps
    print(json.dumps({"baseline": "peft", "mode": "eager", "model": a.model, "layers": layers,
                      "params": n_params, "trainable_params": n_trainable, "r": a.r,
                      "lora_alpha": a.alpha, "targets": a.targets, "grad_ckpt": a.grad_ckpt,
                      "seq_len": a.seq_len, "batch": a.batch, "tokens_per_s": tokens / dt,
                      "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
                      "final_loss": float(loss), "gpu": torch.cuda.get_device_name(),
                      "peft_adapter_dtype": str(trainable[0].dtype)}))


if __name__ == "__main__":
    main()
