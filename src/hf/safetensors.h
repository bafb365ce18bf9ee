// safetensors files (Hugging Face's tensor format): a memory-mapped reader and a writer.
//
// Format (https://github.com/huggingface/safetensors):
//   bytes [0, 8)        N, the header length, uint64 little-endian
//   bytes [8, 8 + N)    JSON object, UTF-8, maybe padded with spaces:
//                         {"<name>": {"dtype": "BF16", "shape": [d0, d1], "data_offsets": [b, e]},
//                          ..., "__metadata__": {"<key>": "<string>", ...}}
//   bytes [8 + N, end)  the data; a tensor's bytes are [b, e) relative to 8 + N, row-major,
//                       little-endian. e - b = numel * dtype size; the tensors cover the data
//                       region exactly, without overlap or holes.
// The reader enforces every rule above and throws UserError naming the file and the tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace qt::hf {

// Every dtype the format defines; the reader converts BF16, F16 and F32 to fp32.
enum class StDType { kBool, kU8, kI8, kF8E4M3, kF8E5M2, kI16, kU16, kF16, kBF16, kI32, kU32,
                     kF32, kI64, kU64, kF64 };

const char* st_dtype_name(StDType t);  // "BF16"
std::size_t st_dtype_size(StDType t);  // bytes per element
std::optional<StDType> st_dtype_from_name(std::string_view name);
bool st_dtype_is_float_readable(StDType t);  // BF16, F16 or F32

// fp32 <-> bf16/f16 bit patterns. To bf16/f16: round to nearest, ties to even, as torch's
// .to(torch.bfloat16); NaN stays NaN (quiet), overflow gives infinity.
std::uint16_t f32_to_bf16(float x);
float bf16_to_f32(std::uint16_t b);
std::uint16_t f32_to_f16(float x);
float f16_to_f32(std::uint16_t h);

struct StTensor {
  std::string name;
  StDType dtype = StDType::kF32;
  std::vector<std::int64_t> shape;
  std::size_t begin = 0, end = 0;  // byte range in the data region
  std::int64_t numel() const;
  std::int64_t rows() const { return shape.empty() ? 1 : shape[0]; }
  std::int64_t row_elems() const;  // elements per row: numel / rows (1 for a 1-D tensor)
};

// A safetensors file, memory-mapped read-only for the object's lifetime; only the pages of
// tensors actually read are touched.
class SafetensorsFile {
 public:
  // Maps and validates `path`; UserError "<path>: ..." on any problem.
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(SafetensorsFile&& o) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&&) = delete;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<StTensor>& tensors() const { return tensors_; }  // sorted by name
  const StTensor* find(const std::string& name) const;               // nullptr when absent
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // The tensor's raw bytes (little-endian elements of its dtype).
  const std::byte* bytes(const StTensor& t) const { return data_ + t.begin; }
  // Rows [r0, r1) of `t` (rows along the first dimension) as fp32 into out[(r1 - r0) * row_elems].
  // UserError when the dtype is not BF16, F16 or F32; the row range must lie inside the tensor.
  void read_rows_f32(const StTensor& t, std::int64_t r0, std::int64_t r1, float* out) const;

 private:
  std::string path_;
  void* map_ = nullptr;
  std::size_t map_size_ = 0;
  const std::byte* data_ = nullptr;  // start of the data region
  std::vector<StTensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Parses and validates a header (the JSON text) against a data region of `data_size` bytes.
// `where` names the file in errors. Tensors come back sorted by name.
std::vector<StTensor> st_parse_header(std::string_view json, std::size_t data_size,
                                      const std::string& where,
                                      std::map<std::string, std::string>* metadata);

// One tensor to write: either `raw` bytes already in `dtype`, or `f32` values converted to
// `dtype` (BF16, F16 or F32 only).
struct StTensorOut {
  std::string name;
  StDType dtype = StDType::kBF16;
  std::vector<std::int64_t> shape;
  const void* raw = nullptr;
  const float* f32 = nullptr;
  std::size_t bytes() const;  // numel * dtype size
};

// Writes a safetensors file: tensors in the given order, header padded with spaces to a multiple
// of 8 bytes. UserError naming the file when it cannot be written.
void write_safetensors(const std::string& path, const std::vector<StTensorOut>& tensors,
                       const std::map<std::string, std::string>& metadata);

}  // namespace qt::hf
