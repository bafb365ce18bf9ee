// An exclusive lock on a directory for one job, so that two runs never write one checkpoint
// directory at once (they would overwrite and prune each other's checkpoints).
//
// The lock is the file DIR/.qtrain.lock, which names its holder (host, pid, batch job, start
// time), held with an fcntl write lock by rank 0 for the lifetime of the DirLock. The kernel (or
// the NFS/Lustre lock manager) releases an fcntl lock when its process dies, so the file of a job
// killed with SIGKILL is stale, not held: the next run takes it over and says so. Where the file
// system has no fcntl locks, the holder's pid is checked instead when it ran on this host; a
// holder on another host is then trusted until its lock file is deleted by hand.
#pragma once

#include <string>

#include "qtrain/comm.h"

namespace qt {

class DirLock {
 public:
  // Collective. Creates `dir` if needed; rank 0 takes the lock. When another live run holds it
  // (or the directory cannot be created or locked), every rank throws the same UserError naming
  // the holder. `what` names the directory for messages ("checkpoint.dir").
  DirLock(const std::string& dir, const std::string& what, Comm& world);
  ~DirLock();  // rank 0: deletes the lock file and releases the lock
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;

  // The lock file's path, DIR/.qtrain.lock.
  static std::string file_in(const std::string& dir);

 private:
  int fd_ = -1;  // rank 0: the open, locked lock file
  std::string path_;
};

}  // namespace qt
