#!/usr/bin/env python3
"""Golden fixtures from HuggingFace transformers for the qtrain engine.

For each qtrain checkpoint given, builds the same Qwen3 in transformers (fp32, eager attention),
loads the checkpoint's weights with h5py, runs a forward and backward on random tokens (seeded)
and writes a fixture file with the weights, inputs, logits, loss and every gradient:

  attrs:    model config fields, torch and transformers versions, seed
  /params/<name>    fp32, transformers name and shape (copied from the checkpoint)
  /input_ids        int64 [B, T]
  /labels           int64 [B, T]   (transformers convention: unshifted, -100 = ignored)
  /logits           fp32 [B, T, V]
  /loss             fp32 scalar (mean over counted shifted labels)
  /grads/<name>     fp32 d loss / d param

Run on a machine with transformers (the GPU machine), outside qtrain's runtime kit:
  python3 tests/reference/make_fixtures.py --out tests/reference/fixtures CKPT.h5 ...
tests/reference/regenerate.sh makes the checkpoints with qtrain first.
"""
import argparse
import os

import h5py
import numpy as np
import torch
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

CONFIG_KEYS = ["vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
               "num_kv_heads", "head_dim", "rope_theta", "rms_norm_eps", "tie_word_embeddings"]


def read_checkpoint(path):
    with h5py.File(path, "r") as f:
        cfg = {k: f.attrs[k].item() if hasattr(f.attrs[k], "item") else f.attrs[k] for k in CONFIG_KEYS}
        params = {name: np.array(ds, dtype=np.float32) for name, ds in f["params"].items()}
    cfg["tie_word_embeddings"] = bool(cfg["tie_word_embeddings"])
    return cfg, params


def rope_parameters(cfg):
    """transformers 5's rope_parameters: plain RoPE, or YaRN from the --yarn option's attrs."""
    p = {"rope_type": "default", "rope_theta": float(cfg["rope_theta"])}
    if cfg.get("rope_type") == "yarn":
        p.update(rope_type="yarn", factor=float(cfg["rope_factor"]),
                 original_max_position_embeddings=int(cfg["rope_original_max_positions"]))
    return p


def build_model(cfg):
    hf = Qwen3Config(
        vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]), num_hidden_layers=int(cfg["num_layers"]),
        num_attention_heads=int(cfg["num_heads"]), num_key_value_heads=int(cfg["num_kv_heads"]),
        head_dim=int(cfg["head_dim"]), rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_parameters=rope_parameters(cfg),
        tie_word_embeddings=cfg["tie_word_embeddings"], attention_bias=False,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)), use_cache=False)
    model = Qwen3ForCausalLM(hf).to(torch.float32)
    model.config._attn_implementation = "eager"
    return model


def make_fixture(ckpt, out_dir, seed, batch, seq_len, yarn=None, suffix=""):
    cfg, params = read_checkpoint(ckpt)
    if yarn:  # FACTOR:ORIGINAL:MAX_POSITIONS
        factor, original, max_pos = yarn.split(":")
        cfg.update(rope_type="yarn", rope_factor=float(factor),
                   rope_original_max_positions=int(original), max_position_embeddings=int(max_pos))
    model = build_model(cfg)
    state = {k: torch.from_numpy(v) for k, v in params.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"lm_head.weight"} and (not missing or cfg["tie_word_embeddings"]), missing
    if cfg["tie_word_embeddings"]:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.eval()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, int(cfg["vocab_size"]), (batch, seq_len), generator=g)
    labels = torch.randint(0, int(cfg["vocab_size"]), (batch, seq_len), generator=g)
    labels[torch.rand((batch, seq_len), generator=g) < 0.2] = -100  # some ignored tokens
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    name = os.path.splitext(os.path.basename(ckpt))[0] + suffix
    path = os.path.join(out_dir, name + ".h5")
    with h5py.File(path, "w") as f:
        for k in CONFIG_KEYS:
            f.attrs[k] = cfg[k]
        for k in ("rope_type", "rope_factor", "rope_original_max_positions",
                  "max_position_embeddings"):
            if k in cfg:
                f.attrs[k] = cfg[k]
        if yarn:  # what transformers made of it: the inverse frequencies and the cos/sin scale
            rot = model.model.rotary_emb
            f.create_dataset("rope_inv_freq", data=rot.inv_freq.detach().numpy().astype(np.float32))
            f.attrs["rope_attention_scaling"] = float(rot.attention_scaling)
        f.attrs["torch_version"] = str(torch.__version__)
        f.attrs["transformers_version"] = str(transformers.__version__)
        f.attrs["seed"] = seed
        f.attrs["source_checkpoint"] = os.path.basename(ckpt)
        for k, v in params.items():
            f.create_dataset("params/" + k, data=v)
        f.create_dataset("input_ids", data=ids.numpy())
        f.create_dataset("labels", data=labels.numpy())
        f.create_dataset("logits", data=out.logits.detach().numpy().astype(np.float32))
        f.create_dataset("loss", data=np.float32(out.loss.item()))
        named = dict(model.named_parameters())
        for k in params:
            grad = named[k].grad
            f.create_dataset("grads/" + k, data=grad.numpy().astype(np.float32))
    print(f"{path}: loss {out.loss.item():.6f}, {len(params)} tensors, "
          f"transformers {transformers.__version__}, torch {torch.__version__}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=20261122)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--yarn", help="FACTOR:ORIGINAL_MAX:MAX_POSITIONS: YaRN rope scaling "
                    "(the fixture named <checkpoint>_yarn)")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    for i, ckpt in enumerate(a.checkpoints):
        make_fixture(ckpt, a.out, a.seed + i, a.batch, a.seq_len, a.yarn, "_yarn" if a.yarn else "")


if __name__ == "__main__":
    main()
