// Qwen3-VL's image processor, the parts that are plain arithmetic (transformers'
// Qwen2VLImageProcessor(Fast); ../shared/docs/qwen3-spec.md 4.1): the target size of an image
// (smart_resize), the normalisation of its 8-bit pixels and the cutting of resized frames into
// the vision tower's patch rows. The resampling itself (torchvision's antialiased bicubic) and
// the decoding of files come with qtrain prep's image support (issue 20).
#pragma once

#include <cstdint>
#include <vector>

#include "vision/vision_config.h"

namespace qt {

struct ImageSize {
  int h = 0, w = 0;  // pixels
  bool operator==(const ImageSize&) const = default;
};

// The size an h x w image is resized to: both sides multiples of `factor` (patch x merge, 32),
// the nearest to the original (Python's round, ties to even), then scaled down (floor) to at most
// max_pixels or up (ceil) to at least min_pixels, keeping the aspect ratio. Throws UserError when
// a side is < 1 or the aspect ratio is above 200 (as transformers refuses it); `what` names the
// image in that message.
ImageSize smart_resize(int h, int w, const char* what, int factor = 32,
                       std::int64_t min_pixels = 65536, std::int64_t max_pixels = 16777216);

// An 8-bit channel value to the tower's input: (v - 127.5) / 127.5 = v / 127.5 - 1, in fp32
// (rescale 1/255 and mean = std = 0.5 fused, as the fast processor).
inline float normalize_pixel(std::uint8_t v) {
  return (static_cast<float>(v) - 127.5f) / 127.5f;
}

// The patch rows of `frames` resized frames, each [3, h, w] fp32 (normalised), h and w
// multiples of patch x merge: frames are taken temporal_patch_size at a time (an image is one
// frame given twice: pass it twice, or use image_patch_rows), each group a grid of
// (h / patch) x (w / patch) patches in merge-block order (bh, bw, mh, mw), each row the vector
// (c, t, py, px) of cfg.patch_dim() values. Returns [groups x gh x gw, patch_dim] and sets
// grid = {groups, gh, gw}.
std::vector<float> patch_rows(const std::vector<const float*>& frames, int h, int w,
                              const VisionConfig& cfg, ImageGrid& grid);

// One image: its frame used for both temporal slots.
std::vector<float> image_patch_rows(const float* frame, int h, int w, const VisionConfig& cfg,
                                    ImageGrid& grid);

}  // namespace qt
