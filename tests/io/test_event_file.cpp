// TensorBoard event files (src/io/event_file.*): CRC-32C's known answers, and a file of known
// scalars and text read back by tests/support/event_file_reader.h, which shares none of the
// writer's framing or checksum code.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "io/crc32c.h"
#include "io/event_file.h"
#include "runtime/process.h"
#include "support/event_file_reader.h"

namespace qt {
namespace {

namespace fs = std::filesystem;

std::string fresh_dir(const std::string& tag) {
  std::string t = (fs::temp_directory_path() / ("qtrain-" + tag + "-XXXXXX")).string();
  if (!mkdtemp(t.data())) return "";
  return t;
}

std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

TEST(Crc32c, KnownAnswers) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);  // the CRC catalogue's check value
  EXPECT_EQ(crc32c("", 0), 0u);
  const std::string zeros(32, '\0'), ones(32, '\xff');  // RFC 3720, B.4
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(crc32c(ones.data(), ones.size()), 0x62A8AB43u);
  // The table and the bitwise form of the test reader agree on every length up to 300 bytes.
  std::string s;
  for (int i = 0; i < 300; ++i) {
    EXPECT_EQ(crc32c(s.data(), s.size()), test::crc32c_bitwise(s)) << "length " << i;
    s.push_back(static_cast<char>(i * 37 + 11));
  }
  // TFRecord's mask: rotate right 15, add 0xa282ead8.
  EXPECT_EQ(crc32c_mask(0xE3069283u), ((0xE3069283u >> 15) | (0xE3069283u << 17)) + 0xa282ead8u);
  EXPECT_EQ(crc32c_mask(0), 0xa282ead8u);
  // A masked value from outside this code: the test of a third-party TFRecord reader
  // (tfrecord_slow, tests of make_masked_crc) gives 4134599430 for "1234567890asdfghjkl".
  const std::string rec = "1234567890asdfghjkl";
  EXPECT_EQ(crc32c_mask(crc32c(rec.data(), rec.size())), 4134599430u);
}

class EventFile : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fresh_dir("events");
    ASSERT_FALSE(dir_.empty());
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string dir_;
};

TEST_F(EventFile, ScalarsAndTextReadBack) {
  const std::string sub = dir_ + "/run/a";  // created with its parents
  const std::string deck = "[train]\nsteps = 3  # a comment\n\xc3\xa9t\xc3\xa9\n";
  {
    EventFileWriter w;
    ASSERT_EQ(w.open(sub), "");
    EXPECT_TRUE(w.write_text(0, "config/deck", deck));
    for (int step = 1; step <= 3; ++step)
      EXPECT_TRUE(w.write_scalars(step, {{"train/loss", 5.5 / step}, {"perf/tokens_per_s", 1e6 + step}}));
    EXPECT_TRUE(w.write_scalars(1LL << 40, {{"train/lr", -3e-4}}));
  }
  const std::vector<std::string> files = test::event_files(sub);
  ASSERT_EQ(files.size(), 1u);
  const std::string host = host_name();
  const std::string name = fs::path(files[0]).filename().string();
  EXPECT_EQ(name.rfind("events.out.tfevents.", 0), 0u) << name;
  EXPECT_EQ(name.substr(name.size() - host.size() - 1), std::string(".") + host) << name;

  const std::vector<std::string> records = test::read_records(files[0]);
  const std::vector<tensorboard::Event> events = test::parse_events(records);
  ASSERT_EQ(events.size(), 6u);
  EXPECT_EQ(events[0].file_version(), "brain.Event:2");
  const double now = unix_time_now();
  for (const tensorboard::Event& e : events) {
    EXPECT_GT(e.wall_time(), now - 600);
    EXPECT_LE(e.wall_time(), now);
  }

  // The text: plugin "text", a rank-0 DT_STRING tensor holding the bytes as given.
  ASSERT_EQ(events[1].summary().value_size(), 1);
  const auto& text = events[1].summary().value(0);
  EXPECT_EQ(events[1].step(), 0);
  EXPECT_EQ(text.tag(), "config/deck");
  EXPECT_EQ(text.metadata().plugin_data().plugin_name(), "text");
  EXPECT_EQ(text.tensor().dtype(), tensorboard::DT_STRING);
  EXPECT_EQ(text.tensor().tensor_shape().dim_size(), 0);
  ASSERT_EQ(text.tensor().string_val_size(), 1);
  EXPECT_EQ(text.tensor().string_val(0), deck);

  const test::ScalarSeries series = test::scalar_series(events);
  ASSERT_EQ(series.size(), 3u);
  ASSERT_EQ(series.at("train/loss").size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(series.at("train/loss")[i].first, i + 1);
    EXPECT_EQ(series.at("train/loss")[i].second, static_cast<float>(5.5 / (i + 1)));
    EXPECT_EQ(series.at("perf/tokens_per_s")[i].second, static_cast<float>(1e6 + i + 1));
  }
  ASSERT_EQ(series.at("train/lr").size(), 1u);
  EXPECT_EQ(series.at("train/lr")[0].first, 1LL << 40);
  EXPECT_EQ(series.at("train/lr")[0].second, -3e-4f);

  // The same bytes walked by field number, as TensorBoard's protos number them: Event
  // wall_time = 1 (double), step = 2, file_version = 3, summary = 5; Summary value = 1;
  // Value tag = 1, simple_value = 2 (float), tensor = 8, metadata = 9; SummaryMetadata
  // plugin_data = 1; PluginData plugin_name = 1; TensorProto dtype = 1 (DT_STRING = 7),
  // tensor_shape = 2, string_val = 8.
  using test::wire_field;
  EXPECT_EQ(wire_field(records[0], 1).type, 1);
  EXPECT_EQ(wire_field(records[0], 3).bytes, "brain.Event:2");
  const std::string loss_event = records[2];  // step 1
  EXPECT_EQ(wire_field(loss_event, 2).value, 1u);
  const test::WireField summary = wire_field(loss_event, 5);
  ASSERT_EQ(summary.type, 2);
  const std::vector<test::WireField> values = test::wire_fields(summary.bytes);
  ASSERT_EQ(values.size(), 2u);
  EXPECT_EQ(values[0].number, 1);
  EXPECT_EQ(wire_field(values[0].bytes, 1).bytes, "train/loss");
  const test::WireField simple = wire_field(values[0].bytes, 2);
  EXPECT_EQ(simple.type, 5);
  EXPECT_EQ(simple.value, float_bits(5.5f));
  EXPECT_EQ(wire_field(records[5], 2).value, 1ULL << 40);
  const std::string text_value = wire_field(wire_field(records[1], 5).bytes, 1).bytes;
  EXPECT_EQ(wire_field(text_value, 1).bytes, "config/deck");
  EXPECT_EQ(wire_field(wire_field(wire_field(text_value, 9).bytes, 1).bytes, 1).bytes, "text");
  const std::string tensor = wire_field(text_value, 8).bytes;
  EXPECT_EQ(wire_field(tensor, 1).value, 7u);
  EXPECT_EQ(wire_field(tensor, 8).bytes, deck);
}

TEST_F(EventFile, ReaderFindsEveryDamagedByte) {
  {
    EventFileWriter w;
    ASSERT_EQ(w.open(dir_), "");
    ASSERT_TRUE(w.write_scalars(7, {{"train/loss", 1.25}}));
  }
  const std::string path = test::event_files(dir_).at(0);
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  ASSERT_NO_THROW(test::read_records(path));
  // Any byte flipped (length, its CRC, data, the data's CRC) or the file cut short: an error.
  for (std::size_t i = 0; i <= bytes.size(); ++i) {
    std::string bad = bytes;
    if (i < bytes.size()) bad[i] = static_cast<char>(bad[i] ^ 0x20);
    else bad.pop_back();
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bad;
    EXPECT_THROW(test::read_records(path), std::runtime_error) << "byte " << i;
  }
}

TEST_F(EventFile, SecondWriterInTheSameSecondGetsItsOwnFile) {
  EventFileWriter a, b;
  ASSERT_EQ(a.open(dir_), "");
  ASSERT_EQ(b.open(dir_), "");
  EXPECT_NE(a.path(), b.path());
  ASSERT_TRUE(a.write_scalars(1, {{"x", 1}}));
  ASSERT_TRUE(b.write_scalars(2, {{"x", 2}}));
  // Both complete, neither truncated by the other.
  EXPECT_EQ(test::read_records(a.path()).size(), 2u);
  EXPECT_EQ(test::read_records(b.path()).size(), 2u);
}

TEST_F(EventFile, RefusesAFileAndAPathThroughOne) {
  const std::string file = dir_ + "/f";
  std::ofstream(file) << "x";
  EventFileWriter w;
  EXPECT_NE(w.open(file).find("not a directory"), std::string::npos);
  EXPECT_NE(w.open(file + "/sub").find("cannot create the directory"), std::string::npos);
  EXPECT_FALSE(w.is_open());
  EXPECT_FALSE(w.write_scalars(1, {{"x", 1}}));
}

}  // namespace
}  // namespace qt
