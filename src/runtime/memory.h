// Host memory: what a node has free, and the check a run makes before it allocates, so that a
// model too large for the machine ends with exit 2 and the numbers instead of std::bad_alloc.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "qtrain/comm.h"

namespace qt {

// Bytes this process may still allocate on its node: MemAvailable of /proc/meminfo, lowered to
// the free part of the cgroup's limit (cgroup v2 memory.max - memory.current, or v1
// memory.limit_in_bytes - memory.usage_in_bytes) where a batch system sets one. Empty when
// neither can be read (then no check is made).
std::optional<std::uint64_t> available_host_bytes();

// "1.5 GiB", "312 MiB", "4.0 KiB", "17 B".
std::string format_bytes(double bytes);

// What one rank is about to allocate on the host, for the message: bytes and what they are
// ("parameters, gradients and AdamW moments of 8.19B parameters + activations of 1 x 4096
// tokens"), and the deck keys that change it.
struct HostMemoryNeed {
  double bytes = 0;   // may exceed 2^64 for absurd shapes: a double, never wraps
  std::string what;   // what the bytes are
  std::string keys;   // which keys to change, e.g. "model.* sizes, train.micro_batch"
};

// Collective over `world`. The ranks of each node add up their needs and compare them with the
// node's available memory (read by the node's first rank); when any node falls short, every
// rank throws the same UserError naming the node, the bytes needed and available and the keys.
// `context` starts the message ("the model", "qtrain generate"). Does nothing where
// available_host_bytes() is empty, except that a need beyond 2^63 bytes is refused anyway.
void check_host_memory(Comm& world, const HostMemoryNeed& need, const std::string& context);

// The same check for one process without MPI collectives (serial tools): throws UserError.
void check_host_memory_local(const HostMemoryNeed& need, const std::string& context);

}  // namespace qt
