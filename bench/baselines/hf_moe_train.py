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


def routing_load(model, a):
    """The expert load of one more forward on fresh random tokens (the timed steps' kind): the
    coefficient of variation of the token-slots per expert (population std / mean) averaged over
    the layers, and the largest max / mean, as qtrain's step log reports them; {} if the router's
    output is not the (logits, weights, indices) of transformers 5.17."""
    counts = []

    def hook(_module, _inputs, out):
        idx = out[-1] if isinstance(out, tuple) else None
        if idx is not None and idx.dtype in (torch.int64, torch.int32):
            counts.append(torch.bincount(idx.flatten(), minlength=model.config.num_experts).double())

    hooks = [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=torch.randint(0, 151936, (a.batch, a.seq_len), device="cuda"))
    for h in hooks:
        h.remove()
    if not counts:
        return {}
    cv = [float(c.std(unbiased=False) / c.mean()) for c in counts]
    worst = max(float(c.max() / c.mean()) for c in counts)
    return {"expert_cv_mean": sum(cv) / len(cv), "expert_max_over_mean": worst}


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
    load = routing_load(model, a)
    print(json.dumps({"baseline": "pytorch+transformers", "model": "qwen3-30b-a3b", "layers": a.layers,
                      "experts_implementation": getattr(model.config, "_experts_implementation", None),
                      "params": n_params, "seq_len": a.seq_len, "batch": a.batch,
                      "tokens_per_s": tokens_per_s, "peak_mem_gib": peak, "final_loss": loss,
                      **load,
                      "gpu": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main()
