// safetensors: bf16/f16 rounding, write -> read round trips of every dtype, and one UserError
// naming the file and the problem for each kind of malformed file.
#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "hf/safetensors.h"
#include "qtrain/error.h"
#include "support/random.h"

namespace qt::hf {
namespace {

namespace fs = std::filesystem;

// A fresh directory per test, removed at the end.
class TempDir {
 public:
  TempDir() {
    std::string t = (fs::temp_directory_path() / "qtrain-st-XXXXXX").string();
    path_ = mkdtemp(t.data());
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (fs::path(path_) / name).string(); }

 private:
  std::string path_;
};

// The value of the neighbour of bf16/f16 pattern h, one unit in the last place away.
double bf16_value(std::uint16_t h) { return bf16_to_f32(h); }
double f16_value(std::uint16_t h) { return f16_to_f32(h); }

// r must be the representable value nearest to x, ties to an even mantissa.
template <typename ToBits, typename Value>
void expect_nearest_even(float x, ToBits to_bits, Value value, const char* what) {
  const std::uint16_t r = to_bits(x);
  const double rv = value(r), d = std::abs(rv - static_cast<double>(x));
  for (int step : {-1, 1}) {
    const std::uint16_t n = static_cast<std::uint16_t>(r + step);
    const double nv = value(n);
    if (!std::isfinite(nv) || std::signbit(nv) != std::signbit(rv)) continue;
    const double dn = std::abs(nv - static_cast<double>(x));
    EXPECT_LE(d, dn) << what << " of " << x << " gave " << r;
    if (d == dn) EXPECT_EQ(r & 1, 0) << what << ": tie of " << x << " must go to even, got " << r;
  }
}

TEST(Conversions, Bf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);      // tie, even stays
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * 0x1p-8f), 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(f32_to_bf16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(f32_to_bf16(3.4028235e38f), 0x7f80);       // rounds past the largest bf16
  EXPECT_EQ(f32_to_bf16(std::nanf("")), 0x7fc0);        // torch's canonical NaN
  EXPECT_EQ(f32_to_bf16(-std::nanf("")), 0x7fc0);
  std::mt19937_64 rng(test::test_seed());
  for (int i = 0; i < 200000; ++i) {
    float x = std::bit_cast<float>(static_cast<std::uint32_t>(rng()));
    if (!std::isfinite(x) || std::abs(x) > 3.38e38f) continue;
    expect_nearest_even(x, f32_to_bf16, bf16_value, "bf16");
    if (HasFailure()) break;
  }
  for (std::uint32_t h = 0; h < 0x10000; ++h) {  // every finite bf16 converts back exactly
    const float v = bf16_to_f32(static_cast<std::uint16_t>(h));
    if (std::isfinite(v)) ASSERT_EQ(f32_to_bf16(v), h);
  }
}

TEST(Conversions, F16RoundsToNearestEvenWithSubnormals) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65519.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);               // tie to the even "65536" = inf
  EXPECT_EQ(f32_to_f16(0x1p-24f), 0x0001);               // smallest subnormal
  EXPECT_EQ(f32_to_f16(0x1p-25f), 0x0000);               // tie to even zero
  EXPECT_EQ(f32_to_f16(0x1.8p-25f), 0x0001);
  EXPECT_EQ(f32_to_f16(-0.0f), 0x8000);
  EXPECT_EQ(f32_to_f16(std::nanf("")) & 0x7e00, 0x7e00);
  std::mt19937_64 rng(test::test_seed());
  std::uniform_real_distribution<float> mag(-30.0f, 17.0f);
  for (int i = 0; i < 200000; ++i) {
    const float x = std::ldexp(std::uniform_real_distribution<float>(1.0f, 2.0f)(rng),
                               static_cast<int>(mag(rng))) * (rng() & 1 ? 1.0f : -1.0f);
    if (std::abs(x) >= 65504.0f) continue;
    expect_nearest_even(x, f32_to_f16, f16_value, "f16");
    if (HasFailure()) break;
  }
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const float v = f16_to_f32(static_cast<std::uint16_t>(h));
    if (std::isfinite(v)) ASSERT_EQ(f32_to_f16(v), h) << h;
  }
}

TEST(Safetensors, EveryDTypeRoundTripsBitForBit) {
  TempDir dir;
  std::mt19937_64 rng(test::test_seed());
  const std::vector<StDType> all = {
      StDType::kBool, StDType::kU8,  StDType::kI8,  StDType::kF8E4M3, StDType::kF8E5M2,
      StDType::kI16,  StDType::kU16, StDType::kF16, StDType::kBF16,   StDType::kI32,
      StDType::kU32,  StDType::kF32, StDType::kI64, StDType::kU64,    StDType::kF64};
  std::vector<std::vector<std::uint8_t>> data;
  std::vector<StTensorOut> out;
  for (std::size_t i = 0; i < all.size(); ++i) {
    StTensorOut t;
    t.name = std::string("t.") + st_dtype_name(all[i]);
    t.dtype = all[i];
    t.shape = {static_cast<std::int64_t>(1 + rng() % 5), static_cast<std::int64_t>(1 + rng() % 7)};
    data.emplace_back(t.bytes());
    for (auto& b : data.back()) b = static_cast<std::uint8_t>(rng());
    if (all[i] == StDType::kBool)
      for (auto& b : data.back()) b &= 1;
    out.push_back(t);
  }
  for (std::size_t i = 0; i < out.size(); ++i) out[i].raw = data[i].data();
  // A scalar and an empty tensor are legal too.
  const float scalar = 2.5f;
  StTensorOut s{"scalar", StDType::kF32, {}, &scalar, nullptr};
  StTensorOut e{"empty", StDType::kF32, {0, 3}, nullptr, &scalar};
  out.push_back(s);
  out.push_back(e);
  const std::string path = dir.file("all.safetensors");
  write_safetensors(path, out, {{"format", "pt"}, {"note", "round trip"}});

  SafetensorsFile f(path);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.metadata().at("note"), "round trip");
  ASSERT_EQ(f.tensors().size(), all.size() + 2);
  for (std::size_t i = 0; i < all.size(); ++i) {
    const StTensor* t = f.find(out[i].name);
    ASSERT_NE(t, nullptr) << out[i].name;
    EXPECT_EQ(t->dtype, all[i]);
    EXPECT_EQ(t->shape, out[i].shape);
    ASSERT_EQ(t->end - t->begin, data[i].size());
    EXPECT_EQ(std::memcmp(f.bytes(*t), data[i].data(), data[i].size()), 0) << out[i].name;
  }
  const StTensor* sc = f.find("scalar");
  ASSERT_NE(sc, nullptr);
  float got = 0;
  f.read_rows_f32(*sc, 0, 1, &got);
  EXPECT_EQ(got, 2.5f);
  EXPECT_EQ(f.find("empty")->numel(), 0);
  EXPECT_EQ(f.find("missing"), nullptr);
  // The header is padded to 8 bytes, so the data region starts aligned.
  std::ifstream in(path, std::ios::binary);
  std::uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ(n % 8, 0u);
}

TEST(Safetensors, FloatTensorsReadAsF32ByRows) {
  TempDir dir;
  std::mt19937_64 rng(test::test_seed());
  const int R = 7, C = 5;
  const auto src = test::random_vector<float>(R * C, rng, 3.0);
  std::vector<StTensorOut> out;
  for (StDType t : {StDType::kBF16, StDType::kF16, StDType::kF32})
    out.push_back({std::string("w.") + st_dtype_name(t), t, {R, C}, nullptr, src.data()});
  const std::int32_t ints[3] = {1, 2, 3};
  out.push_back({"ints", StDType::kI32, {3}, ints, nullptr});
  const std::string path = dir.file("f.safetensors");
  write_safetensors(path, out, {});
  SafetensorsFile f(path);
  for (StDType t : {StDType::kBF16, StDType::kF16, StDType::kF32}) {
    const StTensor& st = *f.find(std::string("w.") + st_dtype_name(t));
    std::vector<float> rows(3 * C);
    f.read_rows_f32(st, 2, 5, rows.data());  // rows [2, 5)
    for (int k = 0; k < 3 * C; ++k) {
      const float x = src[2 * C + k];
      const float want = t == StDType::kF32  ? x
                         : t == StDType::kF16 ? f16_to_f32(f32_to_f16(x))
                                              : bf16_to_f32(f32_to_bf16(x));
      ASSERT_EQ(std::bit_cast<std::uint32_t>(rows[k]), std::bit_cast<std::uint32_t>(want))
          << st_dtype_name(t) << " element " << k;
    }
  }
  float dummy[3];
  try {
    f.read_rows_f32(*f.find("ints"), 0, 3, dummy);
    FAIL() << "an I32 tensor read as floats";
  } catch (const UserError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("\"ints\""), std::string::npos) << m;
    EXPECT_NE(m.find("I32"), std::string::npos) << m;
  }
}

// ---- malformed files: each a UserError naming the file and what is wrong --------------------

std::string file_with_header(const TempDir& dir, const std::string& name, const std::string& header,
                             std::size_t data_bytes, std::int64_t header_len = -1) {
  const std::string path = dir.file(name);
  std::ofstream out(path, std::ios::binary);
  const std::uint64_t n = header_len >= 0 ? static_cast<std::uint64_t>(header_len) : header.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << header;
  out << std::string(data_bytes, '\x01');
  return path;
}

void expect_bad(const std::string& path, const std::vector<std::string>& parts) {
  try {
    SafetensorsFile f(path);
    FAIL() << path << " was accepted";
  } catch (const UserError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(path), std::string::npos) << m;
    for (const std::string& p : parts) EXPECT_NE(m.find(p), std::string::npos) << "'" << p << "' not in: " << m;
  }
}

TEST(SafetensorsErrors, TruncatedFiles) {
  TempDir dir;
  const std::string tiny = dir.file("tiny.safetensors");
  std::ofstream(tiny, std::ios::binary) << "abc";
  expect_bad(tiny, {"truncated", "3 bytes"});
  const std::string h = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  expect_bad(file_with_header(dir, "short_header.safetensors", h, 0, 1000), {"truncated", "1000"});
  expect_bad(file_with_header(dir, "short_data.safetensors", h, 4), {"\"a\"", "beyond", "truncated"});
  expect_bad(file_with_header(dir, "huge.safetensors", h, 8, std::int64_t{1} << 40), {"header length"});
  expect_bad(dir.file("absent.safetensors"), {"cannot open"});
}

TEST(SafetensorsErrors, BadJson) {
  TempDir dir;
  expect_bad(file_with_header(dir, "json.safetensors", R"({"a":{"dtype":"F32",)", 0), {"not valid JSON"});
  expect_bad(file_with_header(dir, "array.safetensors", "[1, 2]", 0), {"does not start with '{'"});
  expect_bad(file_with_header(dir, "dup.safetensors",
                              R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                              R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
             {"\"a\"", "twice"});
  expect_bad(file_with_header(dir, "meta.safetensors", R"({"__metadata__":{"format":1}})", 0),
             {"__metadata__", "format"});
  expect_bad(file_with_header(dir, "field.safetensors",
                              R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}})", 4),
             {"\"a\"", "unknown field \"x\""});
}

TEST(SafetensorsErrors, OffsetsOutOfRangeOverlappingOrLeavingHoles) {
  TempDir dir;
  expect_bad(file_with_header(dir, "range.safetensors",
                              R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8),
             {"\"a\"", "[0, 16]", "beyond the data region of 8 bytes"});
  expect_bad(file_with_header(dir, "reversed.safetensors",
                              R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8),
             {"\"a\"", "end before they begin"});
  expect_bad(file_with_header(dir, "negative.safetensors",
                              R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})", 8),
             {"\"a\"", "data_offsets"});
  expect_bad(file_with_header(dir, "overlap.safetensors",
                              R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                              R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
             {"\"a\"", "\"b\"", "overlap"});
  expect_bad(file_with_header(dir, "hole.safetensors",
                              R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                              R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})", 12),
             {"bytes [4, 8)", "no tensor", "\"b\""});
  expect_bad(file_with_header(dir, "tail.safetensors",
                              R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 12),
             {"12 bytes", "cover only 4"});
}

TEST(SafetensorsErrors, WrongDTypeOrShape) {
  TempDir dir;
  expect_bad(file_with_header(dir, "dtype.safetensors",
                              R"({"a":{"dtype":"F12","shape":[1],"data_offsets":[0,4]}})", 4),
             {"\"a\"", "unknown dtype \"F12\""});
  expect_bad(file_with_header(dir, "nodtype.safetensors",
                              R"({"a":{"shape":[1],"data_offsets":[0,4]}})", 4),
             {"\"a\"", "no dtype"});
  expect_bad(file_with_header(dir, "shape.safetensors",
                              R"({"a":{"dtype":"BF16","shape":[3,2],"data_offsets":[0,8]}})", 8),
             {"\"a\"", "[3, 2]", "needs 12 bytes", "hold 8"});
  expect_bad(file_with_header(dir, "negdim.safetensors",
                              R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4),
             {"\"a\"", "shape entry"});
  expect_bad(file_with_header(dir, "absurd.safetensors",
                              R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}})", 4),
             {"\"a\"", "absurd shape"});
  // 2^62 F32 elements are 2^64 bytes, which wrapped to 0 and matched data_offsets [0, 0]
  // (found by tests/fuzz's safetensors invariant; corpus regression_numel_bytes_wrap).
  expect_bad(file_with_header(dir, "wrap.safetensors",
                              R"({"a":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]}})", 0),
             {"\"a\"", "absurd shape", "2^62 bytes of F32"});
}

}  // namespace
}  // namespace qt::hf
