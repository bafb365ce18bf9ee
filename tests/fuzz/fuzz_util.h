// Shared by the fuzz targets (docs/fuzzing.md): a reader that turns the fuzzer's bytes into
// choices, a scratch file for the parsers that read paths, and the one way a target reports a
// broken invariant. A target catches the errors bad input is allowed to raise (qt::UserError);
// anything else (a crash, a sanitizer report, an uncaught exception, a broken invariant) is a
// finding.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

// A broken invariant of a parser's result: print and abort (libFuzzer keeps the input).
#define QT_FUZZ_ASSERT(cond, what)                                                                \
  do {                                                                                            \
    if (!(cond)) {                                                                                \
      std::fprintf(stderr, "fuzz invariant failed at %s:%d: %s: %s\n", __FILE__, __LINE__, #cond, \
                   std::string(what).c_str());                                                    \
      std::abort();                                                                               \
    }                                                                                             \
  } while (0)

namespace qt::fuzz {

// Consumes the input front to back: small numbers and flags first, the rest as text or bytes.
// Past the end every read gives zero / empty, so each input is a valid program of choices.
class Bytes {
 public:
  Bytes(const std::uint8_t* data, std::size_t size) : p_(data), n_(size) {}

  std::size_t left() const { return n_; }
  std::uint8_t u8() {
    if (n_ == 0) return 0;
    --n_;
    return *p_++;
  }
  bool flag() { return (u8() & 1) != 0; }
  std::uint64_t u64() {
    std::uint64_t v = 0;
    for (int k = 0; k < 8; ++k) v |= static_cast<std::uint64_t>(u8()) << (8 * k);
    return v;
  }
  // An integer in [lo, hi] (hi - lo < 2^32).
  std::int64_t range(std::int64_t lo, std::int64_t hi) {
    const std::uint64_t span = static_cast<std::uint64_t>(hi - lo) + 1;
    std::uint32_t v = 0;
    for (int k = 0; k < 4; ++k) v |= static_cast<std::uint32_t>(u8()) << (8 * k);
    return lo + static_cast<std::int64_t>(v % span);
  }
  // Up to `max` bytes.
  std::string_view take(std::size_t max) {
    const std::size_t k = std::min(max, n_);
    std::string_view s(reinterpret_cast<const char*>(p_), k);
    p_ += k;
    n_ -= k;
    return s;
  }
  // The bytes up to the next `sep` (dropped) or the end.
  std::string_view until(char sep) {
    const auto* q = static_cast<const std::uint8_t*>(std::memchr(p_, sep, n_));
    const std::size_t k = q ? static_cast<std::size_t>(q - p_) : n_;
    std::string_view s = take(k);
    if (q) u8();
    return s;
  }
  std::string_view rest() { return take(n_); }

 private:
  const std::uint8_t* p_;
  std::size_t n_;
};

// A per-process scratch directory for the inputs that parsers read by path.
// Removed by its destructor at exit (after whatever a target registered with atexit later, such
// as MPI_Finalize); a process that crashes leaves it in TMPDIR (scripts/fuzz.sh points TMPDIR
// into its own work directory).
class ScratchDir {
 public:
  ScratchDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl = std::string(tmp && *tmp ? tmp : "/tmp") + "/qtrain-fuzz-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) {
      std::perror("qtrain fuzz: mkdtemp");
      std::abort();
    }
    path_ = tmpl;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

inline const std::filesystem::path& scratch_dir() {
  static const ScratchDir dir;
  return dir.path();
}

// Writes `bytes` to scratch_dir()/name and returns its path.
inline std::string write_scratch(const std::string& name, std::string_view bytes) {
  const std::string path = (scratch_dir() / name).string();
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  f.close();
  QT_FUZZ_ASSERT(f.good(), "cannot write the scratch file " + path);
  return path;
}

}  // namespace qt::fuzz
