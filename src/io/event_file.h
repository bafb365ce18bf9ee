// TensorBoard event files: what tf.summary / PyTorch's SummaryWriter write and TensorBoard reads.
//
// A file is a sequence of records (TFRecord framing), each
//   uint64 length (little endian) | uint32 masked CRC-32C of those 8 bytes |
//   `length` bytes of a serialized Event | uint32 masked CRC-32C of those bytes
// (io/crc32c.h's mask). The first Event holds file_version "brain.Event:2"; the others a Summary:
// scalars as simple_value (the scalars dashboard), text as a rank-0 DT_STRING tensor whose
// metadata names the "text" plugin. The messages are src/io/tensorboard_event.proto, compiled by
// the distribution's protoc. The file is named events.out.tfevents.<unix seconds>.<hostname>,
// which TensorBoard finds in the directory given to --logdir and merges with the others there.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace qt {

class EventFileWriter {
 public:
  struct Scalar {
    std::string tag;  // e.g. "train/loss"; '/' groups the charts
    double value;     // stored as fp32 (simple_value)
  };

  EventFileWriter() = default;
  EventFileWriter(const EventFileWriter&) = delete;
  EventFileWriter& operator=(const EventFileWriter&) = delete;
  ~EventFileWriter();

  // Creates `dir` (with its parents) when missing and a new event file in it, never replacing
  // one: a name already taken (a second writer in the same second) gets ".1", ".2", ... after it.
  // Writes the file_version record. Returns "" or why the file could not be made.
  std::string open(const std::string& dir);
  bool is_open() const { return file_ != nullptr; }
  const std::string& path() const { return path_; }

  // One Event at `step` with these scalars. Each record is flushed to the operating system at
  // once, so a crash of the process loses nothing already written. A failed write closes the
  // file and returns false (the caller warns; training goes on).
  bool write_scalars(std::int64_t step, const std::vector<Scalar>& values);
  // One Event at `step` with `text` under `tag`, shown by TensorBoard's text dashboard (which
  // renders it as Markdown).
  bool write_text(std::int64_t step, const std::string& tag, const std::string& text);

 private:
  bool write_record(const std::string& event);  // framed as above, then flushed

  std::FILE* file_ = nullptr;
  std::string path_;
};

// The seconds since the Unix epoch, as Event.wall_time.
double unix_time_now();

}  // namespace qt
