// safetensors reader (mmap, strict header validation) and writer; format in safetensors.h.
#include "hf/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "qtrain/error.h"

namespace qt::hf {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; this reader assumes a little-endian host");

namespace {

using json = nlohmann::json;

// Larger headers are refused (the reference implementation's limit, against hostile files).
constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

struct DTypeInfo {
  StDType t;
  const char* name;
  std::size_t size;
};
constexpr DTypeInfo kDTypes[] = {
    {StDType::kBool, "BOOL", 1},    {StDType::kU8, "U8", 1},     {StDType::kI8, "I8", 1},
    {StDType::kF8E4M3, "F8_E4M3", 1}, {StDType::kF8E5M2, "F8_E5M2", 1},
    {StDType::kI16, "I16", 2},      {StDType::kU16, "U16", 2},   {StDType::kF16, "F16", 2},
    {StDType::kBF16, "BF16", 2},    {StDType::kI32, "I32", 4},   {StDType::kU32, "U32", 4},
    {StDType::kF32, "F32", 4},      {StDType::kI64, "I64", 8},   {StDType::kU64, "U64", 8},
    {StDType::kF64, "F64", 8}};

const DTypeInfo& info(StDType t) {
  for (const DTypeInfo& d : kDTypes)
    if (d.t == t) return d;
  return kDTypes[0];  // unreachable: every enumerator is in the table
}

std::string shape_text(const std::vector<std::int64_t>& s) {
  return fmt::format("[{}]", fmt::join(s, ", "));
}

// A JSON value that is a non-negative integer (safetensors writes unsigned integers).
std::optional<std::uint64_t> as_uint(const json& v) {
  if (v.is_number_unsigned()) return v.get<std::uint64_t>();
  if (v.is_number_integer() && v.get<std::int64_t>() >= 0) return v.get<std::uint64_t>();
  return std::nullopt;
}

std::string errno_text() { return std::strerror(errno); }

}  // namespace

const char* st_dtype_name(StDType t) { return info(t).name; }
std::size_t st_dtype_size(StDType t) { return info(t).size; }

std::optional<StDType> st_dtype_from_name(std::string_view name) {
  for (const DTypeInfo& d : kDTypes)
    if (name == d.name) return d.t;
  return std::nullopt;
}

bool st_dtype_is_float_readable(StDType t) {
  return t == StDType::kBF16 || t == StDType::kF16 || t == StDType::kF32;
}

std::uint16_t f32_to_bf16(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN: torch gives the canonical quiet NaN
  const std::uint32_t lsb = (u >> 16) & 1u;
  return static_cast<std::uint16_t>((u + 0x7fffu + lsb) >> 16);  // overflow rounds to infinity
}

float bf16_to_f32(std::uint16_t b) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

std::uint16_t f32_to_f16(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);  // NaN
  if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520: inf
  // Rounds q + rem / 2^shift to nearest, ties to even.
  auto round_shift = [](std::uint32_t m, int shift) {
    if (shift >= 32) return 0u;
    std::uint32_t q = m >> shift;
    const std::uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return q;
  };
  const int e = static_cast<int>(a >> 23);
  if (a < 0x38800000u) {  // below 2^-14: a subnormal half, k * 2^-24 with k = x * 2^24
    if (a == 0) return static_cast<std::uint16_t>(sign);
    const std::uint32_t m = (a & 0x7fffffu) | (e ? 0x800000u : 0u);
    const int shift = 126 - std::max(e, 1);
    return static_cast<std::uint16_t>(sign | round_shift(m, shift));
  }
  // Normal: 13 mantissa bits dropped; a carry into the exponent is the right result.
  const std::uint32_t h = (static_cast<std::uint32_t>(e - 112) << 10) | ((a & 0x7fffffu) >> 13);
  const std::uint32_t rem = a & 0x1fffu;
  const std::uint32_t r = h + ((rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ? 1u : 0u);
  return static_cast<std::uint16_t>(sign | r);
}

float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    const float v = std::ldexp(static_cast<float>(m), -24);  // zero or subnormal
    return sign ? -v : v;
  }
  if (e == 31) return std::bit_cast<float>(sign | 0x7f800000u | (m << 13));
  return std::bit_cast<float>(sign | ((e + 112u) << 23) | (m << 13));
}

std::int64_t StTensor::numel() const {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

std::int64_t StTensor::row_elems() const {
  std::int64_t n = 1;
  for (std::size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

std::vector<StTensor> st_parse_header(std::string_view text, std::size_t data_size,
                                      const std::string& where,
                                      std::map<std::string, std::string>* metadata) {
  if (text.empty() || text.front() != '{')
    fail_user("{}: the safetensors header does not start with '{{' (not a safetensors file?)",
              where);
  // Duplicate names would silently replace each other in the parsed object: refuse them.
  std::set<std::string> seen;
  std::string duplicate;
  json::parser_callback_t cb = [&](int depth, json::parse_event_t ev, json& parsed) {
    if (depth == 1 && ev == json::parse_event_t::key && !seen.insert(parsed.get<std::string>()).second)
      duplicate = parsed.get<std::string>();
    return true;
  };
  json root;
  try {
    root = json::parse(text.begin(), text.end(), cb);
  } catch (const json::exception& e) {
    fail_user("{}: the safetensors header is not valid JSON: {}", where, e.what());
  }
  if (!duplicate.empty())
    fail_user("{}: the safetensors header names tensor \"{}\" twice", where, duplicate);
  if (!root.is_object()) fail_user("{}: the safetensors header is not a JSON object", where);

  std::vector<StTensor> out;
  for (auto it = root.begin(); it != root.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) fail_user("{}: __metadata__ is not a JSON object", where);
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          fail_user("{}: __metadata__ entry \"{}\" is not a string", where, m.key());
        if (metadata) (*metadata)[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string t = fmt::format("{}: tensor \"{}\"", where, name);
    if (!v.is_object()) fail_user("{} is not described by a JSON object", t);
    for (auto f = v.begin(); f != v.end(); ++f)
      if (f.key() != "dtype" && f.key() != "shape" && f.key() != "data_offsets")
        fail_user("{} has an unknown field \"{}\" (expected dtype, shape, data_offsets)", t, f.key());
    StTensor st;
    st.name = name;
    if (!v.contains("dtype") || !v["dtype"].is_string()) fail_user("{} has no dtype string", t);
    const std::string dt = v["dtype"].get<std::string>();
    auto dtype = st_dtype_from_name(dt);
    if (!dtype) fail_user("{} has unknown dtype \"{}\"", t, dt);
    st.dtype = *dtype;
    if (!v.contains("shape") || !v["shape"].is_array()) fail_user("{} has no shape array", t);
    // numel * size must not overflow: every product stays below 2^62 bytes (numel alone below
    // 2^62 is not enough: [2^62] of F32 would wrap to 0 bytes and match data_offsets [0, 0]).
    std::uint64_t numel = 1;
    constexpr std::uint64_t kLimit = std::uint64_t{1} << 62;
    const std::uint64_t max_numel = kLimit / st_dtype_size(st.dtype);
    for (const json& d : v["shape"]) {
      auto n = as_uint(d);
      if (!n) fail_user("{} has a shape entry that is not a non-negative integer: {}", t, d.dump());
      if (*n != 0 && numel > max_numel / *n)
        fail_user("{} has an absurd shape {} (more than 2^62 bytes of {})", t,
                  v["shape"].dump(), dt);
      numel *= *n;
      st.shape.push_back(static_cast<std::int64_t>(*n));
    }
    const json* off = v.contains("data_offsets") ? &v["data_offsets"] : nullptr;
    std::optional<std::uint64_t> b, e;
    if (off && off->is_array() && off->size() == 2) b = as_uint((*off)[0]), e = as_uint((*off)[1]);
    if (!b || !e) fail_user("{}: data_offsets must be two non-negative integers [begin, end]", t);
    if (*b > *e) fail_user("{}: data_offsets [{}, {}] end before they begin", t, *b, *e);
    if (*e > data_size)
      fail_user("{}: data_offsets [{}, {}] reach beyond the data region of {} bytes (truncated file?)",
                t, *b, *e, data_size);
    const std::uint64_t want = numel * st_dtype_size(st.dtype);
    if (*e - *b != want)
      fail_user("{}: shape {} of {} needs {} bytes, but data_offsets [{}, {}] hold {}", t,
                shape_text(st.shape), dt, want, *b, *e, *e - *b);
    st.begin = *b;
    st.end = *e;
    out.push_back(std::move(st));
  }
  // The tensors must tile the data region exactly: no overlap, no hole, nothing after the last.
  std::vector<const StTensor*> by_offset;
  for (const StTensor& s : out) by_offset.push_back(&s);
  std::sort(by_offset.begin(), by_offset.end(), [](const StTensor* x, const StTensor* y) {
    return std::pair(x->begin, x->end) < std::pair(y->begin, y->end);
  });
  std::size_t pos = 0;
  const StTensor* prev = nullptr;
  for (const StTensor* s : by_offset) {
    if (s->begin < pos)
      fail_user("{}: tensors \"{}\" and \"{}\" overlap (bytes [{}, {}) and [{}, {}))", where,
                prev->name, s->name, prev->begin, prev->end, s->begin, s->end);
    if (s->begin > pos)
      fail_user("{}: bytes [{}, {}) of the data region belong to no tensor (before \"{}\")", where,
                pos, s->begin, s->name);
    pos = s->end;
    prev = s;
  }
  if (pos != data_size)
    fail_user("{}: the data region has {} bytes, but the tensors cover only {}", where, data_size, pos);
  std::sort(out.begin(), out.end(), [](const StTensor& x, const StTensor& y) { return x.name < y.name; });
  return out;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail_user("{}: cannot open: {}", path, errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail_user("{}: not a regular file", path);
  }
  const std::size_t size = static_cast<std::size_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    fail_user("{}: truncated: {} bytes, shorter than the 8-byte header length", path, size);
  }
  map_ = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);  // the mapping keeps the file
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    fail_user("{}: cannot memory-map it: {}", path, std::strerror(map_errno));
  }
  map_size_ = size;
  const auto* base = static_cast<const std::byte*>(map_);
  std::uint64_t n = 0;
  std::memcpy(&n, base, 8);  // little-endian host (static_assert above)
  try {
    if (n > kMaxHeaderBytes)
      fail_user("{}: header length {} is larger than {} bytes (not a safetensors file?)", path, n,
                kMaxHeaderBytes);
    if (n > size - 8)
      fail_user("{}: truncated: the header length is {} bytes but only {} follow", path, n, size - 8);
    const std::string_view text(reinterpret_cast<const char*>(base + 8), n);
    tensors_ = st_parse_header(text, size - 8 - n, path, &metadata_);
  } catch (...) {
    ::munmap(map_, map_size_);
    map_ = nullptr;
    throw;
  }
  data_ = base + 8 + n;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_) ::munmap(map_, map_size_);
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept
    : path_(std::move(o.path_)),
      map_(std::exchange(o.map_, nullptr)),
      map_size_(std::exchange(o.map_size_, 0)),
      data_(std::exchange(o.data_, nullptr)),
      tensors_(std::move(o.tensors_)),
      metadata_(std::move(o.metadata_)) {}

const StTensor* SafetensorsFile::find(const std::string& name) const {
  auto it = std::lower_bound(tensors_.begin(), tensors_.end(), name,
                             [](const StTensor& t, const std::string& n) { return t.name < n; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

void SafetensorsFile::read_rows_f32(const StTensor& t, std::int64_t r0, std::int64_t r1,
                                    float* out) const {
  if (!st_dtype_is_float_readable(t.dtype))
    fail_user("{}: tensor \"{}\" has dtype {}; qtrain reads BF16, F16 and F32 tensors", path_,
              t.name, st_dtype_name(t.dtype));
  QT_CHECK(0 <= r0 && r0 <= r1 && r1 <= t.rows(), "rows [{}, {}) of {} with {} rows", r0, r1,
           t.name, t.rows());
  const std::size_t esize = st_dtype_size(t.dtype);
  const std::size_t n = static_cast<std::size_t>((r1 - r0) * t.row_elems());
  const std::byte* src = data_ + t.begin + static_cast<std::size_t>(r0 * t.row_elems()) * esize;
  // memcpy per element: the data region need not be aligned.
  switch (t.dtype) {
    case StDType::kF32:
      std::memcpy(out, src, n * 4);
      break;
    case StDType::kBF16:
      for (std::size_t i = 0; i < n; ++i) {
        std::uint16_t b;
        std::memcpy(&b, src + 2 * i, 2);
        out[i] = bf16_to_f32(b);
      }
      break;
    default:  // F16
      for (std::size_t i = 0; i < n; ++i) {
        std::uint16_t h;
        std::memcpy(&h, src + 2 * i, 2);
        out[i] = f16_to_f32(h);
      }
      break;
  }
}

std::size_t StTensorOut::bytes() const {
  std::size_t n = 1;
  for (std::int64_t d : shape) n *= static_cast<std::size_t>(d);
  return n * st_dtype_size(dtype);
}

void write_safetensors(const std::string& path, const std::vector<StTensorOut>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::size_t pos = 0;
  for (const StTensorOut& t : tensors) {
    QT_CHECK((t.raw != nullptr) != (t.f32 != nullptr), "tensor {}: give raw or f32 data", t.name);
    QT_CHECK(t.raw || st_dtype_is_float_readable(t.dtype), "tensor {}: no conversion to {}",
             t.name, st_dtype_name(t.dtype));
    header[t.name] = {{"dtype", st_dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {pos, pos + t.bytes()}}};
    pos += t.bytes();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');

  std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(path.c_str(), "wb"), &std::fclose);
  if (!f) fail_user("cannot create {}: {}", path, errno_text());
  auto put = [&](const void* p, std::size_t n) {
    if (n && std::fwrite(p, 1, n, f.get()) != n) fail_user("cannot write {}: {}", path, errno_text());
  };
  const std::uint64_t n = text.size();
  put(&n, 8);
  put(text.data(), text.size());
  std::vector<std::byte> buf;
  constexpr std::size_t kChunk = std::size_t{1} << 20;  // elements converted at a time
  for (const StTensorOut& t : tensors) {
    if (t.raw) {
      put(t.raw, t.bytes());
      continue;
    }
    const std::size_t es = st_dtype_size(t.dtype), numel = t.bytes() / es;
    for (std::size_t i = 0; i < numel; i += kChunk) {
      const std::size_t m = std::min(kChunk, numel - i);
      buf.resize(m * es);
      for (std::size_t k = 0; k < m; ++k) {
        const float x = t.f32[i + k];
        if (t.dtype == StDType::kF32) {
          std::memcpy(buf.data() + 4 * k, &x, 4);
        } else {
          const std::uint16_t h = t.dtype == StDType::kBF16 ? f32_to_bf16(x) : f32_to_f16(x);
          std::memcpy(buf.data() + 2 * k, &h, 2);
        }
      }
      put(buf.data(), buf.size());
    }
  }
  if (std::fflush(f.get()) != 0) fail_user("cannot write {}: {}", path, errno_text());
  std::FILE* raw = f.release();
  if (std::fclose(raw) != 0) fail_user("cannot write {}: {}", path, errno_text());
}

}  // namespace qt::hf
