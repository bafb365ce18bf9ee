// The Qwen3-VL vision tower's configuration (transformers' Qwen3VLVisionConfig;
// ../shared/docs/qwen3-spec.md 1.2), its parameters in one flat fp32 layout with the official
// checkpoint names (spec 6.3), and the images of a batch (their patch grids).
// Deck keys, presets and HF import come later (issue 20).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "qtrain/params.h"

namespace qt {

struct VisionConfig {
  int hidden_size = 1152;             // hv
  int num_heads = 16;                 // hd = hv / num_heads
  int intermediate_size = 4304;       // iv
  int depth = 27;                     // blocks
  int patch_size = 16;                // pixels per patch side
  int temporal_patch_size = 2;        // frames per patch
  int in_channels = 3;
  int spatial_merge_size = 2;         // the merger joins merge x merge patches
  int out_hidden_size = 2048;         // the language model's hidden size
  int num_position_embeddings = 2304; // a square learned table, 48 x 48
  std::vector<int> deepstack_visual_indexes = {8, 16, 24};  // 0-based blocks
  double layer_norm_eps = 1e-6;
  double rope_theta = 10000.0;

  int head_dim() const { return hidden_size / num_heads; }
  // Elements of one patch's pixel vector, ordered (c, t, py, px): 3 * 2 * 16 * 16 = 1536.
  int patch_dim() const { return in_channels * temporal_patch_size * patch_size * patch_size; }
  int merge_rows() const { return spatial_merge_size * spatial_merge_size; }  // patches a token
  int merged_dim() const { return hidden_size * merge_rows(); }                // 4 hv
  int grid_side() const;  // sqrt(num_position_embeddings); aborts unless a square
  // Aborts with a message naming the field if the configuration is not one the tower can run.
  void validate() const;
};

// One image (t = 1) or video (t frames of temporal patches) of a batch: its grid of patches.
// h and w are multiples of spatial_merge_size.
struct ImageGrid {
  int t = 1, h = 0, w = 0;
  int patches() const { return t * h * w; }
};

// Rows of a batch's patches: the images' patches one after another, each image's frames one
// after another, each frame in merge-block order (bh, bw, mh, mw) as the image processor writes
// pixel_values (spec 4.1).
int total_patches(const std::vector<ImageGrid>& grids);

// Flat-buffer offsets of one block's tensors and of a merger's.
struct VisionBlockOffsets {
  std::size_t norm1_w, norm1_b, qkv_w, qkv_b, proj_w, proj_b, norm2_w, norm2_b, fc1_w, fc1_b,
      fc2_w, fc2_b;
};
struct VisionMergerOffsets {
  std::size_t norm_w, norm_b, fc1_w, fc1_b, fc2_w, fc2_b;
};
struct VisionOffsets {
  std::size_t patch_w, patch_b, pos_embed;
  std::vector<VisionBlockOffsets> blocks;         // [depth]
  VisionMergerOffsets merger;                     // norm over hv
  std::vector<VisionMergerOffsets> deepstack;     // [deepstack_visual_indexes], norm over 4 hv
};

// The tower's parameters, official names (model.visual.*) and shapes, in module order.
ParamLayout vision_param_layout(const VisionConfig& cfg);
// Offsets of vision_param_layout(cfg)'s tensors.
VisionOffsets vision_offsets(const VisionConfig& cfg, const ParamLayout& layout);

}  // namespace qt
