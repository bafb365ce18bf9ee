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

// The peak memory of one rank of a training back end (GPU memory on cuda, host memory on cpu),
// by kind: the step log and metrics report it, `qtrain plan` predicts it.
struct MemorySplit {
  double params = 0;       // weights the model computes with (bf16 on cuda, fp32 on cpu)
  double grads = 0;        // gradients: accumulation buffers, reduced shards, scratch
  double optimizer = 0;    // master weights (where separate) and AdamW moments
  double activations = 0;  // the model's activations and the micro-batch's tokens
  double workspace = 0;    // everything else: GEMM and op workspaces, staging
  double total() const { return params + grads + optimizer + activations + workspace; }
  // "params 8.2 GiB, grads 16.4 GiB, optimizer 49.2 GiB, activations 20.6 GiB, workspace 1 GiB"
  std::string describe() const;
};

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
