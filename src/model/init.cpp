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
#include "qtrain/error.h"
#include "runtime/rng.h"

namespace qt {

namespace {

constexpr std::size_t kSlice = std::size_t{1} << 20;  // elements per unit of work
constexpr unsigned kMaxThreads = 16;

// Fills elements [begin, end) of parameter p into out[0, end - begin).
void init_slice(const ModelConfig& cfg, const ParamInfo& p, std::uint64_t seed, float* out,
                std::size_t begin, std::size_t end) {
  if (p.shape.size() == 1) {  // RMSNorm weights start at one
    std::fill(out, out + (end - begin), 1.0f);
    return;
  }
  const std::uint64_t stream = rng::hash_combine(seed, rng::hash_string(p.name));
  for (std::size_t i = begin; i < end; ++i)
    out[i - begin] = static_cast<float>(cfg.initializer_range * rng::normal(stream, i));
}

// One unit of work: elements [begin, end) of *p (at most kSlice) into out[0, end - begin).
struct Work {
  const ParamInfo* p;
  std::size_t begin, end;
  float* out;
};

// Appends the work of elements [begin, end) of p, into out[0, end - begin), in kSlice units.
void add_work(std::vector<Work>& work, const ParamInfo& p, std::size_t begin, std::size_t end,
              float* out) {
  for (std::size_t b = begin; b < end; b += kSlice)
    work.push_back({&p, b, std::min(end, b + kSlice), out + (b - begin)});
}

// Threads for `slices` units of work: no more than the CPUs this process may run on.
unsigned threads_for(std::size_t slices) {
  // The CPUs this process may run on (mpirun binds each rank to one core by default for small
  // runs), not the machine's: more threads than that only take turns on the same cores.
  unsigned cpus = std::thread::hardware_concurrency();
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cpus = static_cast<unsigned>(CPU_COUNT(&set));
  // Threads only pay for large models (start-up of billions of parameters took tens of seconds).
  return std::clamp<unsigned>(std::min<std::size_t>(cpus, slices / 4), 1, kMaxThreads);
}

void run_work(const ModelConfig& cfg, std::uint64_t seed, const std::vector<Work>& work) {
  const unsigned threads = threads_for(work.size());
  auto run = [&](unsigned t) {
    for (std::size_t k = t; k < work.size(); k += threads)
      init_slice(cfg, *work[k].p, seed, work[k].out, work[k].begin, work[k].end);
  };
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < threads; ++t) pool.emplace_back(run, t);
  run(0);
  for (std::thread& th : pool) th.join();
}

}  // namespace

unsigned init_params_threads(const ParamLayout& layout) {
  std::size_t slices = 0;
  for (const ParamInfo& p : layout.params()) slices += (p.numel + kSlice - 1) / kSlice;
  return threads_for(slices);
}

void init_params(const ModelConfig& cfg, const ParamLayout& layout, std::uint64_t seed,
                 float* params) {
  std::vector<Work> work;
  for (const ParamInfo& p : layout.params()) add_work(work, p, 0, p.numel, params + p.offset);
  run_work(cfg, seed, work);
}

void init_params(const ModelConfig& cfg, const ParamLayout& layout, std::uint64_t seed,
                 const std::vector<FlatPiece>& pieces) {
  const auto& ps = layout.params();  // in flat order, contiguous from 0
  std::vector<Work> work;
  for (const FlatPiece& f : pieces) {
    QT_CHECK(f.range.begin <= f.range.end && f.range.end <= layout.numel(),
             "init_params: piece [{}, {}) outside the {} parameters", f.range.begin, f.range.end,
             layout.numel());
    if (f.range.size() == 0) continue;
    // The tensors the piece meets: from the last one starting at or before its first element.
    auto it = std::upper_bound(ps.begin(), ps.end(), f.range.begin,
                               [](std::size_t x, const ParamInfo& p) { return x < p.offset; });
    for (--it; it != ps.end() && it->offset < f.range.end; ++it) {
      const std::size_t lo = std::max(f.range.begin, it->offset);
      const std::size_t hi = std::min(f.range.end, it->offset + it->numel);
      if (lo < hi)
        add_work(work, *it, lo - it->offset, hi - it->offset, f.data + (lo - f.range.begin));
    }
  }
  run_work(cfg, seed, work);
}

}  // namespace qt
