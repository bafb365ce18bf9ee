// The image decoder (src/vision/image_file.*: decode_image, what qtrain prep's Qwen3-VL images go
// through). Input: the whole file, JPEG, PNG or anything else. A file may only be refused with a
// UserError; an accepted one must give h, w >= 1 within the pixel limit and 3 h w planes.
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "qtrain/error.h"
#include "vision/image_file.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = qt::fuzz::write_scratch(
      "image", std::string_view(reinterpret_cast<const char*>(data), size));
  constexpr std::int64_t kLimit = 1 << 20;  // pixels: keeps a forged header from a huge buffer
  try {
    const qt::DecodedImage img = qt::decode_image(path, "fuzz image", kLimit);
    QT_FUZZ_ASSERT(img.h >= 1 && img.w >= 1, "empty image accepted");
    QT_FUZZ_ASSERT(static_cast<std::int64_t>(img.h) * img.w <= kLimit, "pixel limit passed");
    QT_FUZZ_ASSERT(img.planes.size() == static_cast<std::size_t>(3) * img.h * img.w,
                   "planes of the wrong size");
  } catch (const qt::UserError&) {
  }
  return 0;
}
