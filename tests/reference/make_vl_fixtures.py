#!/usr/bin/env python3
"""Golden fixtures of the Qwen3-VL vision tower and M-RoPE from HuggingFace transformers.

NOT YET RUN: written for transformers 5.17 / torch 2.11 from ../shared/docs/qwen3-spec.md
(sections 1.2, 4.2, 4.4, 6.3) on a machine without them. The first run on the GPU machine must
check every assumption marked ASSUMPTION below (the vision tower's return type and
get_rope_index's signature in 5.17) and fix this script where they differ.

Builds a tiny Qwen3VLForConditionalGeneration (fp32, eager attention) from a fixed seed,
draws every vision parameter afresh (so no bias is zero and no norm weight is one), feeds
pixel_values and image_grid_thw of 2 small images to model.model.visual, and back-propagates
the fixed scalar objective
    J = sum(merged * R_merged) + sum_j sum(deepstack[j] * R_deepstack[j])
with R drawn from the same seed. Writes one HDF5 file (h5py), like make_fixtures.py:

  attrs:    vision config fields, torch and transformers versions, seed
  /params/<name>             fp32, official names (model.visual.*) and shapes (spec 6.3)
  /pixel_values              fp32 [N, 1536], rows in merge-block order (spec 4.1)
  /image_grid_thw            int64 [images, 3]
  /merged                    fp32 [N/4, out_hidden_size]
  /deepstack/<j>             fp32 [N/4, out_hidden_size]
  /objective_weights/merged, /objective_weights/deepstack/<j>   fp32, the R above
  /objective                 fp64 scalar J
  /grads/<name>              fp32 dJ / d param
  /mrope/input_ids           int64 [S] text, <|vision_start|>, <|image_pad|> x tokens, ...
  /mrope/mm_token_type_ids   int64 [S] (0 text, 1 image)
  /mrope/position_ids        int64 [3, S] from get_rope_index (T, H, W)
  /mrope/rope_deltas         int64 scalar

Run on the GPU machine (transformers 5.17, torch 2.11):
  python3 tests/reference/make_vl_fixtures.py --out tests/reference/fixtures_vl
then commit fixtures_vl/vision_tiny.h5 and re-run cmake: tests/vision/test_vl_fixtures.cpp
(qtrain_test_vl_fixtures) checks the CPU program against it.
"""
import argparse
import inspect
import os

import h5py
import numpy as np
import torch
import transformers
from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=24,
              patch_size=16, temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
              num_position_embeddings=2304, deepstack_visual_indexes=[0],
              hidden_act="gelu_pytorch_tanh")
TEXT = dict(vocab_size=160, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=12, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                             "mrope_section": [2, 2, 2], "mrope_interleaved": True})
# special tokens inside the tiny vocabulary
IMAGE_ID, VIDEO_ID, VSTART_ID, VEND_ID = 151, 152, 153, 154
GRIDS = [[1, 4, 6], [1, 2, 4]]  # (t, h, w) patches of the 2 images


def build_model():
    cfg = Qwen3VLConfig(text_config=TEXT, vision_config=VISION, image_token_id=IMAGE_ID,
                        video_token_id=VIDEO_ID, vision_start_token_id=VSTART_ID,
                        vision_end_token_id=VEND_ID, tie_word_embeddings=False)
    model = Qwen3VLForConditionalGeneration(cfg).to(torch.float32)
    model.config._attn_implementation = "eager"
    model.model.visual.config._attn_implementation = "eager"
    model.eval()
    return model


def randomize(visual, g):
    """Fresh values of a sensible scale: Linear N(0, 1/fan_in), norm weights 1 + N(0, 0.2),
    biases N(0, 0.2), the position table N(0, 0.5)."""
    with torch.no_grad():
        for name, p in visual.named_parameters():
            if p.dim() >= 2 and "pos_embed" not in name:
                std = 1.0 / np.sqrt(p[0].numel())
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif "pos_embed" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def unpack_vision_output(out):
    """(merged, [deepstack...]). ASSUMPTION: 4.57 returns a tuple (merged, deepstack list); 5.x
    returns BaseModelOutputWithDeepstackFeatures(last_hidden_state = the blocks' output,
    pooler_output = merged, deepstack_features) as far as code adapted from it shows. Both are
    tried; the first run must confirm which one holds."""
    if isinstance(out, (tuple, list)):
        return out[0], list(out[1])
    for merged_key in ("pooler_output", "last_hidden_state"):
        merged = getattr(out, merged_key, None)
        if merged is None:
            continue
        for ds_key in ("deepstack_features", "deepstack_feature_lists", "deepstack_visual_embeds"):
            ds = getattr(out, ds_key, None)
            if ds is not None:
                return merged, list(ds)
    raise RuntimeError(f"unknown vision output {type(out)}: {list(getattr(out, 'keys', lambda: [])())}")


def rope_index(model, ids, types, grids):
    """get_rope_index with whatever of its arguments this version takes. ASSUMPTION: 5.17's is
    get_rope_index(input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw, attention_mask)
    (spec 4.1/4.4); 4.57's had no mm_token_type_ids and found images after <|vision_start|>."""
    fn = model.model.get_rope_index
    params = inspect.signature(fn).parameters
    kw = dict(input_ids=ids[None], image_grid_thw=grids, video_grid_thw=None,
              attention_mask=torch.ones_like(ids[None]))
    if "mm_token_type_ids" in params:
        kw["mm_token_type_ids"] = types[None]
    kw = {k: v for k, v in kw.items() if k in params}
    pos, deltas = fn(**kw)
    return pos[:, 0, :], deltas.reshape(-1)[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=20261128)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(a.seed)
    g = torch.Generator().manual_seed(a.seed)
    model = build_model()
    visual = model.model.visual
    randomize(visual, g)

    grids = torch.tensor(GRIDS, dtype=torch.int64)
    n = int(sum(t * h * w for t, h, w in GRIDS))
    pixel_dim = 3 * VISION["temporal_patch_size"] * VISION["patch_size"] ** 2
    pixels = (0.5 * torch.randn((n, pixel_dim), generator=g)).to(torch.float32)
    merged, deepstack = unpack_vision_output(visual(pixels, grid_thw=grids))
    assert merged.shape == (n // 4, VISION["out_hidden_size"]), merged.shape
    assert len(deepstack) == len(VISION["deepstack_visual_indexes"])
    r_merged = torch.randn(merged.shape, generator=g)
    r_ds = [torch.randn(d.shape, generator=g) for d in deepstack]
    objective = (merged * r_merged).sum() + sum((d * r).sum() for d, r in zip(deepstack, r_ds))
    objective.backward()

    # M-RoPE of: 3 text, <vs>, image 0 (6 tokens), <ve>, 2 text, <vs>, image 1 (2 tokens), <ve>, 1 text
    tokens = [5, 6, 7, VSTART_ID] + [IMAGE_ID] * 6 + [VEND_ID, 8, 9, VSTART_ID] + [IMAGE_ID] * 2 \
        + [VEND_ID, 10]
    ids = torch.tensor(tokens, dtype=torch.int64)
    types = (ids == IMAGE_ID).to(torch.int64)
    position_ids, rope_deltas = rope_index(model, ids, types, grids)

    path = os.path.join(a.out, "vision_tiny.h5")
    with h5py.File(path, "w") as f:
        for k, v in VISION.items():
            if k != "hidden_act":
                f.attrs[k] = v
        f.attrs["mrope_section"] = TEXT["rope_parameters"]["mrope_section"]
        f.attrs["text_head_dim"] = TEXT["head_dim"]
        f.attrs["text_rope_theta"] = TEXT["rope_parameters"]["rope_theta"]
        f.attrs["torch_version"] = str(torch.__version__)
        f.attrs["transformers_version"] = str(transformers.__version__)
        f.attrs["seed"] = a.seed
        named = dict(visual.named_parameters())
        for k, p in named.items():
            f.create_dataset("params/model.visual." + k, data=p.detach().numpy().astype(np.float32))
            f.create_dataset("grads/model.visual." + k, data=p.grad.numpy().astype(np.float32))
        f.create_dataset("pixel_values", data=pixels.numpy())
        f.create_dataset("image_grid_thw", data=grids.numpy())
        f.create_dataset("merged", data=merged.detach().numpy().astype(np.float32))
        f.create_dataset("objective_weights/merged", data=r_merged.numpy().astype(np.float32))
        for j, (d, r) in enumerate(zip(deepstack, r_ds)):
            f.create_dataset(f"deepstack/{j}", data=d.detach().numpy().astype(np.float32))
            f.create_dataset(f"objective_weights/deepstack/{j}", data=r.numpy().astype(np.float32))
        f.create_dataset("objective", data=np.float64(objective.item()))
        f.create_dataset("mrope/input_ids", data=ids.numpy())
        f.create_dataset("mrope/mm_token_type_ids", data=types.numpy())
        f.create_dataset("mrope/position_ids", data=position_ids.numpy().astype(np.int64))
        f.create_dataset("mrope/rope_deltas", data=np.int64(rope_deltas.item()))
    print(f"{path}: objective {objective.item():.6f}, {len(named)} tensors, "
          f"transformers {transformers.__version__}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
