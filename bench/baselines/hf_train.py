#!/usr/bin/env python3
"""PyTorch + transformers training baseline for qtrain's benchmark (same GPU, same run).

Qwen3 built from its config (random weights), bf16 parameters, SDPA attention, fused AdamW,
`--batch` sequences of `--seq-len` tokens per step; eager or under torch.compile. Prints one JSON
line: tokens/s over the timed steps (after warm-up), peak GPU memory.

  python3 bench/baselines/hf_train.py --model qwen3-0.6b --seq-len 4096 --batch 2 [--compile]
  python3 bench/baselines/hf_train.py --model qwen3-8b --layers 8 ...   (8B-shaped layers)
"""
import argparse
import json
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

PRESETS = {  # hidden, intermediate, layers, heads, kv heads, tied (qwen3-spec.md 1.1)
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, True),
    "qwen3-1.7b": (2048, 6144, 28, 16, 8, True),
    "qwen3-4b": (2560, 9728, 36, 32, 8, True),
    "qwen3-8b": (4096, 12288, 36, 32, 8, False),
}


def add_common_args(ap):
    """The options every baseline takes (hf_train.py, peft_train.py)."""
    ap.add_argument("--model", default="qwen3-0.6b", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=0, help="override the layer count")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)


def qwen3_config(a):
    """(Qwen3Config, layer count) of a --model preset with its --layers override."""
    h, i, layers, nh, nkv, tied = PRESETS[a.model]
    layers = a.layers or layers
    cfg = Qwen3Config(vocab_size=151936, hidden_size=h, intermediate_size=i, num_hidden_layers=layers,
                      num_attention_heads=nh, num_key_value_heads=nkv, head_dim=128,
                      tie_word_embeddings=tied, max_position_embeddings=40960,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}, use_cache=False)
    return cfg, layers


def time_training(model_fn, opt, a, accum=1):
    """Trains --warmup untimed then --steps timed steps of `accum` micro-batches of --batch x
    --seq-len random tokens (labels = inputs; the loss of each divided by `accum`). Returns
    (tokens/s of this process, peak GPU GiB of the timed steps, last micro-batch's loss)."""
    ids = torch.randint(0, 151936, (a.batch, a.seq_len), device="cuda")

    def step():
        for _ in range(accum):
            loss = model_fn(input_ids=ids, labels=ids).loss
            (loss / accum).backward()
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
    return (a.batch * a.seq_len * accum * a.steps / dt, torch.cuda.max_memory_allocated() / 2**30,
            float(loss))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()
    cfg, layers = qwen3_config(a)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    step_fn = model
    if a.compile:
        step_fn = torch.compile(model)
    n_params = sum(p.numel() for p in model.parameters())
    tokens_per_s, peak, loss = time_training(step_fn, opt, a)
    print(json.dumps({"baseline": "pytorch+transformers", "mode": "compile" if a.compile else "eager",
                      "model": a.model, "layers": layers, "params": n_params, "seq_len": a.seq_len,
                      "batch": a.batch, "tokens_per_s": tokens_per_s, "peak_mem_gib": peak,
                      "final_loss": loss, "gpu": torch.cuda.get_device_name()}))


if __name__ == "__main__":
    main()
