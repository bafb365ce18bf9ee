// Image files for Qwen3-VL (qtrain prep): a JPEG or PNG file decoded to 8-bit RGB channel
// planes as transformers' load_image does (PIL's Image.open(...).convert("RGB")): grayscale
// replicated, a palette expanded, alpha dropped (not composited), 16-bit samples to their high
// byte (PIL reads 16-bit colour PNGs so; its 16-bit grayscale clips instead: such files differ);
// JPEG through libjpeg-turbo with PIL's settings (islow DCT, fancy upsampling).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace qt {

struct DecodedImage {
  int h = 0, w = 0;
  std::vector<std::uint8_t> planes;  // [3, h, w]: R, G, B
};

// Pixels an image may have before decoding is refused (PIL's decompression-bomb limit is
// 89,478,485; twice that is an error there).
inline constexpr std::int64_t kMaxImagePixels = 178956970;

// Decodes the file at `path`, its format told by its first bytes. `what` names it in errors
// (e.g. "data.jsonl:12: images/cat.jpg"). Throws UserError "<what>: ..." when the file cannot be
// read, is neither JPEG nor PNG, is truncated (as PIL, which refuses a JPEG that libjpeg would
// finish in grey) or corrupt, has more than max_pixels pixels (checked from the header, before any
// decoding), or is a CMYK JPEG.
DecodedImage decode_image(const std::string& path, const std::string& what,
                          std::int64_t max_pixels = kMaxImagePixels);

}  // namespace qt
