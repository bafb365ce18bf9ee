// Token files (format: include/qtrain/data.h, docs/data.md): internals exposed for tests and tools.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "qtrain/data.h"

namespace qt {

// Files whose tokens and loss mask take at most this many bytes are read into memory at open;
// larger ones are read window by window.
inline constexpr std::size_t kTokenFileResidentBytes = std::size_t{256} << 20;

// The input token of padding (data.packing = padded): its targets are -100 and causal attention
// keeps document tokens from seeing it, so its value never changes a loss or a gradient.
inline constexpr std::int32_t kPadToken = 0;

// open_token_file with an explicit memory limit (tests use 0 to exercise the on-demand reads).
std::unique_ptr<DataSource> open_token_file_limited(const std::string& path, int vocab, int T,
                                                    std::uint64_t seed,
                                                    std::size_t max_resident_bytes,
                                                    Packing packing = Packing::kConcat,
                                                    TokenSplit split = {});

// The order of the `windows` windows in epoch `epoch`: a Fisher-Yates shuffle driven by splitmix64
// seeded with rng::hash_combine(seed, epoch). Sample g uses window order[g % windows] of epoch
// g / windows.
std::vector<std::int64_t> token_window_order(std::int64_t windows, std::uint64_t seed,
                                             std::int64_t epoch);

}  // namespace qt
