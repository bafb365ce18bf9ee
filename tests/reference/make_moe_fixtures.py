#!/usr/bin/env python3
"""Golden fixtures of tiny Qwen3-MoE models from HuggingFace transformers (issue 18).

Each fixture is a tiny Qwen3MoeForCausalLM (fp32, eager attention, eager experts) with random
weights drawn here (seeded, wide, so routing is decisive and no weight is near zero), one
forward and backward on random tokens with output_router_logits=True, so that the loss is
cross-entropy + router_aux_loss_coef x the load-balancing loss (qwen3-spec.md 3.3):

  attrs:    the model config (qtrain's names), torch and transformers versions, seed
  /params/<name>    fp32, transformers 5's runtime names and shapes (experts fused:
                    mlp.experts.gate_up_proj [E, 2 Im, H], mlp.experts.down_proj [E, H, Im])
  /input_ids, /labels   int64 [B, T] (labels unshifted, -100 ignored)
  /logits           fp32 [B, T, V]
  /loss             fp32: ce_loss + router_aux_loss_coef x aux_loss, what backward differentiates
  /ce_loss, /aux_loss   fp32
  /grads/<name>     fp32 d loss / d param

and, beside it, <name>_hf/ (config.json, model.safetensors) as save_pretrained writes it: the
checkpoint format with per-expert names, for qtrain's import and export tests.

Run where transformers is (the GPU machine), outside qtrain's runtime kit:
  python3 tests/reference/make_moe_fixtures.py --out tests/reference/fixtures_moe
"""
import argparse
import json
import os

import h5py
import numpy as np
import torch
import transformers
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

# name: the variant's config (shared: below)
VARIANTS = {
    "moe_norm_topk": dict(norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1,
                          tie_word_embeddings=False),
    "moe_no_norm_topk_tied": dict(norm_topk_prob=False, mlp_only_layers=[], decoder_sparse_step=2,
                                  tie_word_embeddings=True),
}
SHARED = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=6,
              num_experts_per_tok=2, moe_intermediate_size=16, router_aux_loss_coef=0.05,
              rms_norm_eps=1e-6, max_position_embeddings=4096, attention_bias=False,
              use_cache=False, output_router_logits=True)
ROPE_THETA = 10000.0


def build(variant):
    kw = dict(SHARED, **VARIANTS[variant])
    cfg = Qwen3MoeConfig(**kw, rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA})
    cfg._attn_implementation = "eager"
    model = Qwen3MoeForCausalLM(cfg).to(torch.float32)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    else:
        model.config._experts_implementation = "eager"
    return cfg, model


def make(variant, out_dir, seed, batch, seq_len):
    cfg, model = build(variant)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm weights around 1
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    model.eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=g)
    labels[torch.rand((batch, seq_len), generator=g) < 0.2] = -100
    out = model(input_ids=ids, labels=labels, output_router_logits=True)
    aux = float(out.aux_loss)
    ce = float(out.loss) - cfg.router_aux_loss_coef * aux
    out.loss.backward()
    path = os.path.join(out_dir, variant + ".h5")
    named = dict(model.named_parameters())
    with h5py.File(path, "w") as f:
        attrs = {
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_layers": cfg.num_hidden_layers,
            "num_heads": cfg.num_attention_heads, "num_kv_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim, "rope_theta": ROPE_THETA, "rms_norm_eps": cfg.rms_norm_eps,
            "tie_word_embeddings": int(cfg.tie_word_embeddings), "num_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "norm_topk_prob": int(cfg.norm_topk_prob),
            "decoder_sparse_step": cfg.decoder_sparse_step,
            "mlp_only_layers": np.array(cfg.mlp_only_layers or [-1], dtype=np.int64),
            "router_aux_loss_coef": cfg.router_aux_loss_coef}
        for k, v in attrs.items():
            f.attrs[k] = v
        f.attrs["torch_version"] = str(torch.__version__)
        f.attrs["transformers_version"] = str(transformers.__version__)
        f.attrs["experts_implementation"] = str(getattr(model.config, "_experts_implementation", "?"))
        f.attrs["seed"] = seed
        for k, p in named.items():
            f.create_dataset("params/" + k, data=p.detach().numpy().astype(np.float32))
            f.create_dataset("grads/" + k, data=p.grad.numpy().astype(np.float32))
        f.create_dataset("input_ids", data=ids.numpy())
        f.create_dataset("labels", data=labels.numpy())
        f.create_dataset("logits", data=out.logits.detach().numpy().astype(np.float32))
        f.create_dataset("loss", data=np.float32(out.loss.item()))
        f.create_dataset("ce_loss", data=np.float32(ce))
        f.create_dataset("aux_loss", data=np.float32(aux))
    hf_dir = os.path.join(out_dir, variant + "_hf")
    model.save_pretrained(hf_dir, safe_serialization=True)
    from safetensors import safe_open
    with safe_open(os.path.join(hf_dir, "model.safetensors"), "pt") as st:
        keys = sorted(st.keys())
    print(f"{path}: loss {out.loss.item():.6f} (ce {ce:.6f}, aux {aux:.6f}), "
          f"{len(named)} tensors, experts {getattr(model.config, '_experts_implementation', '?')}, "
          f"transformers {transformers.__version__}, torch {torch.__version__}")
    print(f"  {hf_dir}: {len(keys)} tensors, e.g. {[k for k in keys if 'experts' in k][:3]}")
    print("  config.json:", json.dumps({k: v for k, v in json.load(open(os.path.join(hf_dir, "config.json"))).items()
                                        if k in ("architectures", "num_experts", "norm_topk_prob", "mlp_only_layers",
                                                 "decoder_sparse_step", "output_router_logits", "head_dim", "dtype")}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=20261127)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=12)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for i, v in enumerate(VARIANTS):
        make(v, a.out, a.seed + i, a.batch, a.seq_len)


if __name__ == "__main__":
    main()
