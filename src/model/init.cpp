// Deterministic, mesh-independent initialisation (transformers' _init_weights for Qwen3).
// Value i of a tensor depends only on (seed, tensor name, i), so the work is split over threads
// freely: the result is the same bits for any thread count.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "model/qwen3.h"
#include "runtime/rng.h"

namespace qt {

namespace {

constexpr std::size_t kSlice = std::size_t{1} << 20;  // elements per unit of work
constexpr unsigned kMaxThreads = 16;

// Fills elements [begin, end) of parameter p.
void init_slice(const ModelConfig& cfg, const ParamInfo& p, std::uint64_t seed, float* params,
                std::size_t begin, std::size_t end) {
  float* w = params + p.offset;
  if (p.shape.size() == 1) {  // RMSNorm weights start at one
    std::fill(w + begin, w + end, 1.0f);
    return;
  }
  const std::uint64_t stream = rng::hash_combine(seed, rng::hash_string(p.name));
  for (std::size_t i = begin; i < end; ++i)
    w[i] = static_cast<float>(cfg.initializer_range * rng::normal(stream, i));
}

}  // namespace

void init_params(const ModelConfig& cfg, const ParamLayout& layout, std::uint64_t seed,
                 float* params) {
  struct Work {
    const ParamInfo* p;
    std::size_t begin, end;
  };
  std::vector<Work> work;
  for (const ParamInfo& p : layout.params())
    for (std::size_t b = 0; b < p.numel; b += kSlice)
      work.push_back({&p, b, std::min(p.numel, b + kSlice)});
  // Threads only pay for large models (start-up of billions of parameters took tens of seconds).
  const unsigned threads = std::clamp<unsigned>(
      std::min<std::size_t>(std::thread::hardware_concurrency(), work.size() / 4), 1, kMaxThreads);
  auto run = [&](unsigned t) {
    for (std::size_t k = t; k < work.size(); k += threads)
      init_slice(cfg, *work[k].p, seed, params, work[k].begin, work[k].end);
  };
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < threads; ++t) pool.emplace_back(run, t);
  run(0);
  for (std::thread& th : pool) th.join();
}

}  // namespace qt
