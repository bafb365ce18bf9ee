#!/usr/bin/env python3
"""PyTorch + transformers Qwen3-MoE training baseline for bench/moe_slice.sh (same GPU, same run).

Qwen3MoeForCausalLM with Qwen3-30B-A3B's shapes (--layers of them; random weights), bf16
parameters, SDPA attention, transformers' default experts implementation (grouped_mm), fused
AdamW, causal LM loss only (output_router_logits off, transformers' default), `--batch` sequences
of `--seq-len` random tokens a step. Prints one JSON line: tokens/s over the timed steps (after
warm-up), peak GPU memory, the experts implementation used.

  python3 bench/baselines/hf_moe_train.py --layers 4 --seq-len 4096 --batch 2
"""
import argparse
import json

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from hf_train import time_training


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()
    cfg = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                         moe_intermediate_size=768, num_hidden_layers=a.layers,
                         num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                         decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
                         max_position_embeddings=40960, output_router_logits=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6}, use_cache=False)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    n_params = sum(p.numel() for p in model.parameters())
    tokens_per_s, peak, loss = time_training(model, opt, a)
    print(json.dumps({"baseline": "pytorch+transformers", "model": "qwen3-30b-a3b", "layers": a.layers,
                      "experts_implementation": getattr(model.config, "_experts_implementation", None),
                      "params": n_params, "seq_len": a.seq_len, "batch": a.batch,
                      "tokens_per_s": tokens_per_s, "peak_mem_gib": peak, "final_loss": loss,
                      "gpu": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main()
