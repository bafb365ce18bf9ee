#!/usr/bin/env python3
"""Golden fixtures of the Qwen3-VL image processor from torchvision and transformers.

NOT YET RUN: written for transformers 5.17 / torch 2.11 / torchvision on a machine without
them. The first run (on the GPU machine's CPU: the resize must run on the CPU, as in
transformers' fast processor) must check the ASSUMPTION below.

For a few 8-bit RGB images of awkward sizes (random pixels and smooth gradients from a fixed
seed), writes one HDF5 file (h5py):

  /images/<k>/input          uint8 [3, h, w]   the image, channel planes
  /images/<k>/resized        uint8 [3, hb, wb] torchvision.transforms.v2.functional.resize(
                             input, [hb, wb], BICUBIC, antialias=True) at smart_resize's size
  /images/<k>/pixel_values   fp32 [gh * gw, 1536] the processor's rows (spec 4.1)
  /images/<k>/grid           int64 [3]          image_grid_thw
  attrs: torch, torchvision and transformers versions, seed, count

Run:
  python3 tests/reference/make_vl_processor_fixtures.py --out tests/reference/fixtures_vl
then commit fixtures_vl/processor.h5 and re-run cmake: tests/vision/test_vl_processor_fixture.cpp
(qtrain_test_vl_processor_fixture) checks smart_resize, resize_bicubic_aa, the normalisation and
patch_rows against it.
"""
import argparse
import os

import h5py
import numpy as np
import torch
import torchvision
import transformers
from torchvision.transforms.v2 import functional as F
from torchvision.transforms import InterpolationMode

SEED = 20261128
SIZES = [(37, 53), (300, 200), (70, 1000), (1100, 900), (256, 256), (33, 6600)]


def make_images(rng):
    out = []
    for i, (h, w) in enumerate(SIZES):
        if i % 2 == 0:
            img = rng.integers(0, 256, size=(3, h, w), dtype=np.uint8)
        else:  # smooth: gradients with a little noise, as photographs are
            y, x = np.mgrid[0:h, 0:w]
            base = np.stack([255 * y / max(h - 1, 1), 255 * x / max(w - 1, 1),
                             127 + 120 * np.sin((x + y) / 17.0)])
            img = np.clip(base + rng.normal(0, 6, size=base.shape), 0, 255).round().astype(np.uint8)
        out.append(img)
    return out


def processor():
    # ASSUMPTION: transformers 5.17 exposes Qwen2VLImageProcessorFast with these arguments; the
    # Qwen3-VL preprocessor_config.json gives patch 16, merge 2, temporal 2, mean = std = 0.5,
    # shortest_edge 65536 and longest_edge 16777216 (spec 4.1).
    from transformers import Qwen2VLImageProcessorFast
    return Qwen2VLImageProcessorFast(
        patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5], size={"shortest_edge": 65536, "longest_edge": 16777216},
        do_convert_rgb=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
    rng = np.random.default_rng(SEED)
    images = make_images(rng)
    proc = processor()
    path = os.path.join(args.out, "processor.h5")
    with h5py.File(path, "w") as f:
        f.attrs["torch"] = torch.__version__
        f.attrs["torchvision"] = torchvision.__version__
        f.attrs["transformers"] = transformers.__version__
        f.attrs["seed"] = SEED
        f.attrs["count"] = len(images)
        for k, img in enumerate(images):
            h, w = img.shape[1:]
            hb, wb = smart_resize(h, w, factor=32, min_pixels=65536, max_pixels=16777216)
            t = torch.from_numpy(img)
            resized = F.resize(t, [hb, wb], interpolation=InterpolationMode.BICUBIC, antialias=True)
            out = proc(images=[t], return_tensors="pt")
            g = f.create_group(f"images/{k}")
            g["input"] = img
            g["resized"] = resized.numpy()
            g["pixel_values"] = out["pixel_values"].float().numpy()
            g["grid"] = out["image_grid_thw"][0].numpy().astype(np.int64)
            print(f"image {k}: {h}x{w} -> {hb}x{wb}, grid {g['grid'][()]}")
    print("wrote", path)


if __name__ == "__main__":
    main()
