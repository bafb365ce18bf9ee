#include "io/dir_lock.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <optional>

#include "qtrain/error.h"
#include "runtime/process.h"

namespace qt {

namespace fs = std::filesystem;

namespace {

// "host vm, pid 1234, Slurm job 5678, started 2026-11-26 08:00:00 UTC"
std::string holder_text() {
  std::string job;
  for (const auto& [var, name] : {std::pair{"SLURM_JOB_ID", "Slurm job"},
                                  std::pair{"PBS_JOBID", "PBS job"},
                                  std::pair{"LSB_JOBID", "LSF job"}}) {
    if (const char* v = std::getenv(var); v != nullptr && *v != '\0') {
      job = fmt::format(", {} {}", name, v);
      break;
    }
  }
  char when[64] = "?";
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  if (gmtime_r(&now, &utc) != nullptr) std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", &utc);
  return fmt::format("host {}, pid {}{}, started {}", host_name(), ::getpid(), job, when);
}

// The holder line of an open lock file ("" when empty or unreadable).
std::string read_holder(int fd) {
  char buf[512] = {};
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  if (n <= 0) return "";
  std::string s(buf, static_cast<std::size_t>(n));
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  return s;
}

bool write_holder(int fd) {
  const std::string text = holder_text() + "\n";
  return ::ftruncate(fd, 0) == 0 &&
         ::pwrite(fd, text.data(), text.size(), 0) == static_cast<ssize_t>(text.size()) &&
         ::fsync(fd) == 0;
}

// Whether the holder line names a process of this host that no longer exists.
bool holder_dead_here(const std::string& holder) {
  const std::string host = "host " + host_name() + ", pid ";
  if (holder.rfind(host, 0) != 0) return false;
  const long pid = std::strtol(holder.c_str() + host.size(), nullptr, 10);
  return pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

std::string in_use(const std::string& dir, const std::string& what, const std::string& path,
                   const std::string& holder) {
  return fmt::format(
      "{} = {} is in use by another qtrain run ({}); two runs in one directory would overwrite "
      "and delete each other's checkpoints: wait for that run to end, or set {} to another "
      "directory. If that run is not running any more, delete {}",
      what, dir, holder.empty() ? "its lock file names no holder" : holder, what, path);
}

}  // namespace

std::string DirLock::file_in(const std::string& dir) {
  return (fs::path(dir) / ".qtrain.lock").string();
}

DirLock::DirLock(const std::string& dir, const std::string& what, Comm& world)
    : path_(file_in(dir)) {
  std::string err;
  if (world.rank() == 0) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    fd_ = ec ? -1 : ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) {
      err = fmt::format("{} = {}: cannot create the lock file {}: {}", what, dir, path_,
                        ec ? ec.message() : std::strerror(errno));
    } else {
      struct flock fl {};
      fl.l_type = F_WRLCK;
      fl.l_whence = SEEK_SET;  // l_start = l_len = 0: the whole file
      const std::string before = read_holder(fd_);
      if (::fcntl(fd_, F_SETLK, &fl) == 0) {
        // Locked. A holder line left behind is a run that died without releasing it.
        if (!before.empty())
          std::printf("taking over the stale lock %s of a run that is no longer running (%s)\n",
                      path_.c_str(), before.c_str());
      } else if (errno == EACCES || errno == EAGAIN) {
        err = in_use(dir, what, path_, before);
      } else if (!before.empty() && !holder_dead_here(before)) {
        // No fcntl locks on this file system: trust a holder that is alive or elsewhere.
        err = in_use(dir, what, path_, before);
      }
      if (err.empty() && !write_holder(fd_))
        err = fmt::format("{} = {}: cannot write the lock file {}: {}", what, dir, path_,
                          std::strerror(errno));
      if (!err.empty()) {
        ::close(fd_);  // releases nothing we hold; the other run's file stays as it is
        fd_ = -1;
      }
    }
  }
  agree(world, err);
}

DirLock::~DirLock() {
  if (fd_ < 0) return;
  ::unlink(path_.c_str());  // still locked: no other run can have taken it meanwhile
  ::close(fd_);
}

}  // namespace qt
