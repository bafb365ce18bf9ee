// Where each patch of a batch sits, and what follows from it (../shared/docs/qwen3-spec.md 4.2):
// its (row, col) in its frame, the four taps of the learned position table interpolated to the
// image's grid, the 2-D RoPE angles, and the frame boundaries the attention keeps to.
// Patch rows are in the order of total_patches (vision_config.h): merge-block order
// (bh, bw, mh, mw) within a frame: row = bh * m + mh, col = bw * m + mw (m = spatial_merge_size).
#pragma once

#include <array>
#include <vector>

#include "vision/vision_config.h"

namespace qt {

struct PatchCoord {
  int row = 0, col = 0;
};

// [total_patches(grids)] the (row, col) of each patch within its frame.
std::vector<PatchCoord> patch_coordinates(const std::vector<ImageGrid>& grids, int merge);

// Bilinear interpolation of the side x side table to an h x w grid, align_corners=True:
//   sr = row (side - 1) / max(h - 1, 1), r0 = floor(sr), r1 = min(r0 + 1, side - 1), dr = sr - r0
//   (the same for columns), taps (r0,c0) (r0,c1) (r1,c0) (r1,c1) with weights
//   (1-dr)(1-dc), (1-dr) dc, dr (1-dc), dr dc  (fp32). A clamped tap keeps its weight dr or dc,
//   which is 0 there, so the weights always sum to 1.
struct PositionTaps {
  std::array<int, 4> index;     // rows of the table (r * side + c)
  std::array<float, 4> weight;
};
// [total_patches(grids)]: each patch's taps; a video's frames repeat the first frame's.
std::vector<PositionTaps> position_taps(const std::vector<ImageGrid>& grids, int merge, int side);

// The 2-D RoPE angles' cos and sin, [total_patches, hd/2] each, fp32: with
// inv[j] = 1 / theta^(2j / (hd/2)) (j < hd/4), angle[i] = row inv[i] for i < hd/4 and
// col inv[i - hd/4] after; the rotation is rotate_half's over hd (the angle of i + hd/2 = i's).
void rope2d_table(std::vector<float>& cos, std::vector<float>& sin,
                  const std::vector<ImageGrid>& grids, int merge, int hd, double theta);

// cu_seqlens: [frames + 1] row offsets of each frame of each image (attention stays in a frame).
std::vector<int> frame_offsets(const std::vector<ImageGrid>& grids);

// What the ops need of a batch's images besides the activations: built once per batch on the
// host (a GPU back end would upload it in set_batch).
struct VisionBatch {
  std::vector<ImageGrid> grids;
  int patches = 0;                    // N = total_patches(grids)
  std::vector<PositionTaps> taps;     // [N]
  std::vector<float> rope_cos, rope_sin;  // [N, hd/2] each
  std::vector<int> frames;            // cu_seqlens [frames + 1]
};
VisionBatch make_vision_batch(const VisionConfig& cfg, const std::vector<ImageGrid>& grids);

}  // namespace qt
