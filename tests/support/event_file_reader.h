// A reader of TensorBoard event files for the tests, independent of the writer (src/io/event_file.*
// and io/crc32c.*): its own record framing and a bitwise CRC-32C, protobuf's parser for the
// Events, and a raw wire-format walker to check field numbers against TensorBoard's protos
// (tensorboard/compat/proto/{event,summary,tensor,tensor_shape}.proto) without the .proto that
// qtrain compiles. Needs QTRAIN_PROTO_INCLUDE_DIR and protobuf::libprotobuf.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "io/tensorboard_event.pb.h"

namespace qt::test {

// CRC-32C one bit at a time (reflected polynomial 0x82F63B78), and TFRecord's mask.
inline std::uint32_t crc32c_bitwise(const std::string& bytes) {
  std::uint32_t c = 0xFFFFFFFFu;
  for (unsigned char b : bytes) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
  }
  return ~c;
}
inline std::uint32_t masked_crc32c(const std::string& bytes) {
  const std::uint32_t c = crc32c_bitwise(bytes);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

inline std::uint64_t read_le(const std::string& s, std::size_t at, int bytes) {
  std::uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(s[at + i]);
  return v;
}

// Every record's data in `path`; throws std::runtime_error naming the record and what is wrong
// (a truncated record, a CRC that does not match).
inline std::vector<std::string> read_records(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string s = ss.str();
  std::vector<std::string> out;
  std::size_t at = 0;
  while (at < s.size()) {
    const std::string where = path + ", record " + std::to_string(out.size());
    if (s.size() - at < 12) throw std::runtime_error(where + ": truncated header");
    const std::uint64_t len = read_le(s, at, 8);
    if (read_le(s, at + 8, 4) != masked_crc32c(s.substr(at, 8)))
      throw std::runtime_error(where + ": length CRC mismatch");
    if (s.size() - at - 12 < len + 4) throw std::runtime_error(where + ": truncated data");
    std::string data = s.substr(at + 12, len);
    if (read_le(s, at + 12 + len, 4) != masked_crc32c(data))
      throw std::runtime_error(where + ": data CRC mismatch");
    out.push_back(std::move(data));
    at += 12 + len + 4;
  }
  return out;
}

inline std::vector<tensorboard::Event> parse_events(const std::vector<std::string>& records) {
  std::vector<tensorboard::Event> out;
  for (const std::string& r : records) {
    tensorboard::Event e;
    if (!e.ParseFromString(r)) throw std::runtime_error("a record is not an Event");
    out.push_back(std::move(e));
  }
  return out;
}

// The event files of `dir` (names holding "tfevents", as TensorBoard finds them), sorted by name.
inline std::vector<std::string> event_files(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().filename().string().find("tfevents") != std::string::npos)
      out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

// tag -> (step, value) of every simple_value in `events`, in file order.
using ScalarSeries = std::map<std::string, std::vector<std::pair<std::int64_t, float>>>;
inline ScalarSeries scalar_series(const std::vector<tensorboard::Event>& events) {
  ScalarSeries out;
  for (const tensorboard::Event& e : events)
    for (const auto& v : e.summary().value())
      if (v.value_case() == tensorboard::Summary::Value::kSimpleValue)
        out[v.tag()].push_back({e.step(), v.simple_value()});
  return out;
}

// One field of a protobuf message on the wire: number, wire type (0 varint, 1 fixed64, 2 bytes,
// 5 fixed32) and the value (the integer for 0, 1 and 5, the bytes for 2).
struct WireField {
  int number = 0, type = 0;
  std::uint64_t value = 0;
  std::string bytes;
};

inline std::vector<WireField> wire_fields(const std::string& m) {
  std::vector<WireField> out;
  std::size_t at = 0;
  auto varint = [&]() {
    std::uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (at >= m.size()) throw std::runtime_error("truncated varint");
      const unsigned char b = static_cast<unsigned char>(m[at++]);
      v |= static_cast<std::uint64_t>(b & 0x7F) << shift;
      if (!(b & 0x80)) return v;
    }
    throw std::runtime_error("varint too long");
  };
  while (at < m.size()) {
    const std::uint64_t key = varint();
    WireField f;
    f.number = static_cast<int>(key >> 3);
    f.type = static_cast<int>(key & 7);
    if (f.type == 0) {
      f.value = varint();
    } else if (f.type == 1 || f.type == 5) {
      const int n = f.type == 1 ? 8 : 4;
      if (m.size() - at < static_cast<std::size_t>(n)) throw std::runtime_error("truncated fixed");
      f.value = read_le(m, at, n);
      at += n;
    } else if (f.type == 2) {
      const std::uint64_t n = varint();
      if (m.size() - at < n) throw std::runtime_error("truncated bytes");
      f.bytes = m.substr(at, n);
      at += n;
    } else {
      throw std::runtime_error("wire type " + std::to_string(f.type));
    }
    out.push_back(std::move(f));
  }
  return out;
}

// The first field `number` of a message, or a field of number 0 when there is none.
inline WireField wire_field(const std::string& m, int number) {
  for (WireField& f : wire_fields(m))
    if (f.number == number) return f;
  return {};
}

}  // namespace qt::test
