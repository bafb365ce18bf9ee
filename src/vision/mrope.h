// Interleaved M-RoPE of the Qwen3-VL language model (../shared/docs/qwen3-spec.md 4.4): the
// (time, height, width) position of every token, as transformers' get_rope_index computes it,
// and the rotary cos/sin tables that interleave the three axes over the frequency slots.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "vision/vision_config.h"

namespace qt {

// mm_token_type_ids: 0 text, 1 image, 2 video.
enum class TokenType : std::uint8_t { kText = 0, kImage = 1, kVideo = 2 };

struct MRopePositions {
  std::vector<std::int64_t> t, h, w;  // [S] each (the rows of transformers' [3, S])
  std::int64_t rope_delta = 0;        // max over the three rows + 1 - S (for generation)
};

// Walks the maximal runs of equal token types (no padding):
//   text run of n tokens: all three rows cur, cur + 1, .., cur + n - 1; cur += n
//   image run: the next image of `images` (grid t, h, w; its run has t h w / merge^2 tokens),
//     tokens in raster order over (ti, hi, wi) of the merged grid (t, h / merge, w / merge):
//     T = cur + ti, H = cur + hi, W = cur + wi;  then cur += max(h, w) / merge (t = 1 for
//     images, so this is max(T, H, W) + 1)
//   video run: the next frame of `videos` (each video's t frames in order, each its own run,
//     separated by text such as timestamps), the image rule with t = 1.
// Aborts if a run's length does not match its grid or the grids run out.
MRopePositions mrope_positions(const std::vector<TokenType>& types,
                               const std::vector<ImageGrid>& images,
                               const std::vector<ImageGrid>& videos, int merge);

// The axis (0 T, 1 H, 2 W) of frequency slot i < hd/2 under mrope_section {sT, sH, sW}:
// H if i % 3 == 1 and i < 3 sH; W if i % 3 == 2 and i < 3 sW; T otherwise.
int mrope_axis(int i, const std::array<int, 3>& section);

// cos, sin [S, hd/2] (fp32, as transformers before its cast to the model's dtype):
// angle[s, i] = float(pos_axis(i)[s]) * inv_freq[i], inv_freq[i] = 1 / theta^(2i / hd) in fp32.
// The rotation is rotate_half's (ops/rope.h: slot i turns the pair (i, i + hd/2)).
// sT + sH + sW must be hd/2.
void mrope_table(std::vector<float>& cos, std::vector<float>& sin, const MRopePositions& pos,
                 int hd, double theta, const std::array<int, 3>& section);

}  // namespace qt
