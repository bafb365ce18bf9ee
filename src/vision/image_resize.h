// The Qwen3-VL image processor's resampling: torchvision's resize of 8-bit images with
// InterpolationMode.BICUBIC and antialias=True on the CPU (what transformers' fast processor
// runs), i.e. ATen's separable antialiased bicubic for uint8 (aten/src/ATen/native/cpu/
// UpSampleKernel.cpp, the int16-weight path), written anew from its description:
//   - per output pixel i of a dimension (in -> out pixels, scale = in / out):
//       center = scale (i + 0.5); support = 2 max(scale, 1); first tap = max(trunc(center -
//       support + 0.5), 0), past the last = min(trunc(center + support + 0.5), in);
//       w_j = cubic((first + j - center + 0.5) / max(scale, 1)), Keys' cubic with a = -0.5,
//       normalised to sum 1 (double);
//   - the weights to int16 with `precision` fraction bits, the largest p < 22 at which the
//     largest weight times 2^(p + 1) still rounds below 2^15; each rounded half away from zero;
//   - a pass: out = clamp((2^(p-1) + sum_j in[first + j] w16_j) >> p, 0, 255), an arithmetic
//     shift (floor);
//   - width first (when it changes), then height on the 8-bit result (when it changes).
#pragma once

#include <cstdint>
#include <vector>

namespace qt {

// One dimension's taps: output pixel i reads in[first[i] .. first[i] + count[i]) with weights
// w16[i * max_taps + j] (int16, `precision` fraction bits); w the double weights before rounding.
struct ResampleTaps {
  int max_taps = 0;
  unsigned precision = 0;
  std::vector<int> first, count;  // [out]
  std::vector<double> w;          // [out, max_taps], zero past count
  std::vector<std::int16_t> w16;  // [out, max_taps]
};
ResampleTaps bicubic_aa_taps(int in, int out);

// src [C, h, w] 8-bit channel planes -> [C, out_h, out_w].
std::vector<std::uint8_t> resize_bicubic_aa(const std::uint8_t* src, int C, int h, int w,
                                            int out_h, int out_w);

}  // namespace qt
