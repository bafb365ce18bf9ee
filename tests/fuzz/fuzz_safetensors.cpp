// The safetensors reader (src/hf/safetensors.*: SafetensorsFile, what `[model] init` and
// `qtrain export`'s checks open). Input: the whole file (8-byte header length, JSON header,
// data). A file may only be refused with a UserError; an accepted one must describe tensors that
// lie inside its data region with exactly numel x dtype-size bytes each, and every BF16, F16 or
// F32 tensor must read (first and last rows) without touching memory outside the mapping.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "hf/safetensors.h"
#include "qtrain/error.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = qt::fuzz::write_scratch(
      "model.safetensors", std::string_view(reinterpret_cast<const char*>(data), size));
  try {
    const qt::hf::SafetensorsFile f(path);
    std::uint64_t header = 0;  // accepted: size >= 8 and header <= size - 8
    std::memcpy(&header, data, 8);
    const std::uint64_t data_size = size - 8 - header;
    std::vector<float> rows;
    for (const qt::hf::StTensor& t : f.tensors()) {
      const std::string what = "tensor " + t.name;
      QT_FUZZ_ASSERT(t.begin <= t.end && t.end <= data_size, what);
      // numel x size without overflow, equal to the byte range.
      unsigned __int128 bytes = qt::hf::st_dtype_size(t.dtype);
      for (std::int64_t d : t.shape) {
        QT_FUZZ_ASSERT(d >= 0, what + ": negative dimension");
        bytes *= static_cast<std::uint64_t>(d);
        if (bytes > (static_cast<unsigned __int128>(1) << 64)) break;
      }
      QT_FUZZ_ASSERT(bytes == t.end - t.begin,
                     what + ": numel x dtype size differs from its data_offsets");
      if (!qt::hf::st_dtype_is_float_readable(t.dtype) || t.numel() == 0) continue;
      // Element counts are bounded by the file's size (checked above), so reading a row is cheap.
      const std::int64_t r = t.rows();
      rows.resize(static_cast<std::size_t>(t.row_elems()));
      f.read_rows_f32(t, 0, 1, rows.data());
      f.read_rows_f32(t, r - 1, r, rows.data());
    }
    QT_FUZZ_ASSERT(f.find("\x01 no such tensor") == nullptr, "find of an absent name");
  } catch (const qt::UserError&) {
  }
  return 0;
}
