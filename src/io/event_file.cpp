#include "io/event_file.h"

#include <fmt/format.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "io/crc32c.h"
#include "io/tensorboard_event.pb.h"
#include "runtime/process.h"

namespace qt {

namespace {

namespace fs = std::filesystem;

// The file name's host part: the process's host, "localhost" when it has none.
std::string file_host() {
  const std::string h = host_name();
  return h.empty() || h == "?" ? "localhost" : h;
}

void put_le(char* out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xFFu);
}

}  // namespace

double unix_time_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

EventFileWriter::~EventFileWriter() {
  if (file_) std::fclose(file_);
}

std::string EventFileWriter::open(const std::string& dir) {
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    return "it is not a directory; name a directory (or leave it empty for none)";
  fs::create_directories(dir, ec);
  if (ec) return "cannot create the directory: " + ec.message();
  const double now = unix_time_now();
  const std::string base = (fs::path(dir) / fmt::format("events.out.tfevents.{}.{}",
                                                        static_cast<long long>(now), file_host()))
                               .string();
  // "x": fail rather than truncate a file that exists (C11; glibc opens it with O_EXCL).
  for (int n = 0; n < 1000 && !file_; ++n) {
    path_ = n == 0 ? base : fmt::format("{}.{}", base, n);
    errno = 0;
    file_ = std::fopen(path_.c_str(), "wbx");
    if (!file_ && errno != EEXIST)
      return fmt::format("cannot create the event file {}: {}", path_, std::strerror(errno));
  }
  if (!file_) return fmt::format("cannot create an event file beside {} (1000 names taken)", base);
  tensorboard::Event e;
  e.set_wall_time(now);
  e.set_step(0);
  e.set_file_version("brain.Event:2");
  if (!write_record(e.SerializeAsString()))
    return fmt::format("cannot write the event file {}: {}", path_, std::strerror(errno));
  return "";
}

bool EventFileWriter::write_scalars(std::int64_t step, const std::vector<Scalar>& values) {
  if (!file_) return false;
  tensorboard::Event e;
  e.set_wall_time(unix_time_now());
  e.set_step(step);
  tensorboard::Summary* s = e.mutable_summary();
  for (const Scalar& v : values) {
    tensorboard::Summary::Value* out = s->add_value();
    out->set_tag(v.tag);
    out->set_simple_value(static_cast<float>(v.value));
  }
  return write_record(e.SerializeAsString());
}

bool EventFileWriter::write_text(std::int64_t step, const std::string& tag,
                                 const std::string& text) {
  if (!file_) return false;
  tensorboard::Event e;
  e.set_wall_time(unix_time_now());
  e.set_step(step);
  tensorboard::Summary::Value* v = e.mutable_summary()->add_value();
  v->set_tag(tag);
  v->mutable_metadata()->mutable_plugin_data()->set_plugin_name("text");
  tensorboard::TensorProto* t = v->mutable_tensor();
  t->set_dtype(tensorboard::DT_STRING);
  t->mutable_tensor_shape();  // rank 0: no dims, one string
  t->add_string_val(text);
  return write_record(e.SerializeAsString());
}

bool EventFileWriter::write_record(const std::string& event) {
  char header[12], footer[4];
  put_le(header, event.size(), 8);
  put_le(header + 8, crc32c_mask(crc32c(header, 8)), 4);
  put_le(footer, crc32c_mask(crc32c(event.data(), event.size())), 4);
  errno = 0;
  const bool ok = std::fwrite(header, 1, sizeof header, file_) == sizeof header &&
                  std::fwrite(event.data(), 1, event.size(), file_) == event.size() &&
                  std::fwrite(footer, 1, sizeof footer, file_) == sizeof footer &&
                  std::fflush(file_) == 0;
  if (!ok) {
    const int err = errno;
    std::fclose(file_);
    file_ = nullptr;
    errno = err;
  }
  return ok;
}

}  // namespace qt
