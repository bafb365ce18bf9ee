// Deterministic, mesh-independent initialisation (transformers' _init_weights for Qwen3).
// Value i of a tensor depends only on (seed, tensor name, i), so the work is split over threads
// freely: the result is the same bits for any thread count.
#include <sched.h>

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

unsigned init_params_threads(const ParamLayout& layout) {
  std::size_t slices = 0;
  for (const ParamInfo& p : layout.params()) slices += (p.numel + kSlice - 1) / kSlice;
  // The CPUs this process may run on (mpirun binds each rank to one core by default for small
  // runs), not the machine's: more threads than that only take turns on the same cores.
  unsigned cpus = std::thread::hardware_concurrency();
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cpus = static_cast<unsigned>(CPU_COUNT(&set));
  // Threads only pay for large models (start-up of billions of parameters took tens of seconds).
  return std::clamp<unsigned>(std::min<std::size_t>(cpus, slices / 4), 1, kMaxThreads);
}

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
  const unsigned threads = init_params_threads(layout);
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
