// The host memory one rank of a training run will allocate, estimated from the deck before
// anything is allocated, so that a model too large for the machine stops with exit 2 and the
// numbers (runtime/memory.h) instead of std::bad_alloc.
#pragma once

#include "qtrain/deck.h"
#include "runtime/memory.h"

namespace qt {

// The large buffers of the back end deck.train.device selects, on a rank of `dp` data-parallel
// ranks: parameters, gradients and AdamW moments (ZeRO-1 shards them), and on the CPU the
// activations of one micro-batch. A lower bound: small buffers are left out.
HostMemoryNeed training_host_memory(const Deck& deck, int dp);

}  // namespace qt
