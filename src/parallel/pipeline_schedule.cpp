// Pipeline schedules: the greedy list scheduler and the simulator that checks any schedule.
#include "parallel/pipeline_schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <deque>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>

#include "config/ini_lines.h"
#include "qtrain/error.h"

namespace qt {

namespace {

constexpr double kNever = std::numeric_limits<double>::infinity();

// Finish times of every action of a step, [virtual stage][micro-batch], kNever until done.
struct Finish {
  std::vector<std::vector<double>> f, b, w;  // forward; backward or its input half; weight half
  Finish(int K, int M)
      : f(K, std::vector<double>(M, kNever)), b(f), w(f) {}
};

double cost_of(PipeOp op, const PipeCosts& c) {
  switch (op) {
    case PipeOp::kForward: return c.forward;
    case PipeOp::kBackward: return c.backward;
    case PipeOp::kBackwardInput: return c.backward_input;
    case PipeOp::kBackwardWeight: return c.backward_weight;
  }
  return 0;
}

// The time action a may start given what has finished (kNever: not yet known).
double ready_at(const PipeAction& a, const Finish& fin, int K) {
  const int k = a.chunk, m = a.micro_batch;
  switch (a.op) {
    case PipeOp::kForward: return k == 0 ? 0.0 : fin.f[k - 1][m];
    case PipeOp::kBackward:
    case PipeOp::kBackwardInput:
      return std::max(fin.f[k][m], k == K - 1 ? 0.0 : fin.b[k + 1][m]);
    case PipeOp::kBackwardWeight: return fin.b[k][m];
  }
  return kNever;
}

void record(const PipeAction& a, double end, Finish& fin) {
  const int k = a.chunk, m = a.micro_batch;
  if (a.op == PipeOp::kForward) fin.f[k][m] = end;
  if (a.op == PipeOp::kBackward) fin.b[k][m] = fin.w[k][m] = end;
  if (a.op == PipeOp::kBackwardInput) fin.b[k][m] = end;
  if (a.op == PipeOp::kBackwardWeight) fin.w[k][m] = end;
}

void check(const PipeScheduleConfig& cfg) {
  QT_CHECK(cfg.stages >= 1 && cfg.micro_batches >= 1 && cfg.virtual_chunks >= 1,
           "pipeline schedule of {} stages, {} micro-batches, {} chunks", cfg.stages,
           cfg.micro_batches, cfg.virtual_chunks);
}

}  // namespace

namespace {

// Interleaved 1F1B (Megatron's order; M a multiple of P): stage s's k-th forward is of its local
// chunk (k / P) % V, micro-batch (k / (P V)) P + k % P, its k-th backward the same with the
// chunks in reverse; (P - s - 1) 2 + (V - 1) P forwards warm up, then one forward and one
// backward in turn, then the remaining backwards.
PipeSchedule interleaved(const PipeScheduleConfig& cfg) {
  const int P = cfg.stages, M = cfg.micro_batches, V = cfg.virtual_chunks;
  if (cfg.split_backward)
    throw std::invalid_argument("interleaved schedules with split backwards are not built yet");
  if (M % P != 0)
    throw std::invalid_argument(fmt::format(
        "an interleaved schedule needs micro-batches ({}) in multiples of the stages ({})", M, P));
  const int total = M * V;
  PipeSchedule out(P);
  for (int s = 0; s < P; ++s) {
    auto nth = [&](PipeOp op, int k) {
      const int v = (k / P) % V;
      const int chunk = (op == PipeOp::kForward ? v : V - 1 - v) * P + s;
      return PipeAction{op, chunk, (k / (P * V)) * P + k % P};
    };
    const int warmup = std::min(total, (P - s - 1) * 2 + (V - 1) * P);
    int f = 0, b = 0;
    while (f < warmup) out[s].push_back(nth(PipeOp::kForward, f++));
    while (f < total) {
      out[s].push_back(nth(PipeOp::kForward, f++));
      out[s].push_back(nth(PipeOp::kBackward, b++));
    }
    while (b < total) out[s].push_back(nth(PipeOp::kBackward, b++));
  }
  return out;
}

// Interleaved with split backwards: the forwards and input halves in interleaved 1F1B's order
// (each backward's input half where the backward was); each input half's weight half waits in a
// queue and runs where the stage's next forward or input half is not ready yet (its bubble, found
// by running the lists with unit costs), once max_weights_waiting (default P - s) wait, and at
// the end.
PipeSchedule interleaved_split(const PipeScheduleConfig& cfg) {
  PipeScheduleConfig whole = cfg;
  whole.split_backward = false;
  const PipeSchedule order = interleaved(whole);
  const int P = cfg.stages, M = cfg.micro_batches, K = P * cfg.virtual_chunks;
  const PipeCosts costs;
  Finish fin(K, M);
  PipeSchedule out(P);
  std::vector<std::size_t> next(P, 0);
  std::vector<std::deque<PipeAction>> owed(P);  // weight halves waiting, oldest first
  std::vector<double> free_at(P, 0.0);
  const int total = K * M * 3;
  int placed = 0;
  double t = 0;
  while (placed < total) {
    for (int s = 0; s < P; ++s) {
      if (free_at[s] > t) continue;
      const std::size_t waiting = cfg.max_weights_waiting > 0 ? cfg.max_weights_waiting : P - s;
      // A weight half in the queue is ready: its input half has finished (the stage is free).
      std::optional<PipeAction> pick;
      if (owed[s].size() < waiting && next[s] < order[s].size()) {
        PipeAction a = order[s][next[s]];
        if (a.op == PipeOp::kBackward) a.op = PipeOp::kBackwardInput;
        if (ready_at(a, fin, K) <= t) pick = a;
      }
      if (!pick && !owed[s].empty()) pick = owed[s].front();
      if (!pick) continue;
      const PipeAction a = *pick;
      if (a.op == PipeOp::kBackwardWeight) {
        owed[s].pop_front();
      } else {
        ++next[s];
        if (a.op == PipeOp::kBackwardInput)
          owed[s].push_back({PipeOp::kBackwardWeight, a.chunk, a.micro_batch});
      }
      const double end = t + cost_of(a.op, costs);
      record(a, end, fin);
      out[s].push_back(a);
      free_at[s] = end;
      ++placed;
    }
    double later = kNever;
    for (double f : free_at)
      if (f > t) later = std::min(later, f);
    QT_CHECK(later < kNever || placed == total, "interleaved split scheduler stuck at t = {}", t);
    t = later;
  }
  return out;
}

}  // namespace

PipeSchedule schedule(const PipeScheduleConfig& cfg) {
  check(cfg);
  if (cfg.virtual_chunks != 1) return cfg.split_backward ? interleaved_split(cfg) : interleaved(cfg);
  const int P = cfg.stages, M = cfg.micro_batches, K = P * cfg.virtual_chunks;
  const PipeOp back = cfg.split_backward ? PipeOp::kBackwardInput : PipeOp::kBackward;
  const PipeCosts costs;
  Finish fin(K, M);
  std::vector<std::vector<char>> started_f(K, std::vector<char>(M, 0)), started_b = started_f,
                                                                         started_w = started_f;
  PipeSchedule out(P);
  std::vector<double> free_at(P, 0.0);
  std::vector<int> in_flight(P, 0);  // forwards begun whose backward (input half) has not begun
  std::vector<int> weights_owed(P, 0);  // input halves done whose weight half has not begun
  const int total = K * M * (cfg.split_backward ? 3 : 2);
  int placed = 0;
  double t = 0;
  while (placed < total) {
    for (int s = 0; s < P; ++s) {
      if (free_at[s] > t) continue;
      // 1F1B's memory: stage s holds at most P - s micro-batches. Weight halves may wait, at
      // most max_weights_waiting (default P - s) of them.
      const int limit = P - s;
      const int waiting = cfg.max_weights_waiting > 0 ? cfg.max_weights_waiting : P - s;
      const bool weights_due = weights_owed[s] >= waiting;
      // With one chunk a stage, stage s runs chunk s. The oldest micro-batch that `wanted` and
      // whose inputs are ready.
      auto oldest_ready = [&](PipeOp op, auto&& wanted) -> std::optional<PipeAction> {
        for (int m = 0; m < M; ++m) {
          const PipeAction a{op, s, m};
          if (wanted(m) && ready_at(a, fin, K) <= t) return a;
        }
        return std::nullopt;
      };
      auto weight_half = [&] {
        return oldest_ready(PipeOp::kBackwardWeight,
                            [&](int m) { return started_b[s][m] && !started_w[s][m]; });
      };
      // Backward (or its input half) first; weight halves when too many wait; forward within
      // the memory limit; weight halves fill what is left.
      std::optional<PipeAction> pick = oldest_ready(back, [&](int m) { return !started_b[s][m]; });
      if (!pick && cfg.split_backward && weights_due) pick = weight_half();
      if (!pick && in_flight[s] < limit)
        pick = oldest_ready(PipeOp::kForward, [&](int m) { return !started_f[s][m]; });
      if (!pick && cfg.split_backward) pick = weight_half();
      if (!pick) continue;
      const PipeAction a = *pick;
      const double end = t + cost_of(a.op, costs);
      if (a.op == PipeOp::kForward) started_f[a.chunk][a.micro_batch] = 1, ++in_flight[s];
      if (a.op == back) started_b[a.chunk][a.micro_batch] = 1, --in_flight[s];
      if (a.op == PipeOp::kBackwardInput) ++weights_owed[s];
      if (a.op == PipeOp::kBackwardWeight) started_w[a.chunk][a.micro_batch] = 1, --weights_owed[s];
      record(a, end, fin);
      out[s].push_back(a);
      free_at[s] = end;
      ++placed;
    }
    // The next moment something changes: a stage becomes free or an action finishes.
    double next = kNever;
    for (double f : free_at)
      if (f > t) next = std::min(next, f);
    QT_CHECK(next < kNever || placed == total, "pipeline scheduler stuck at t = {}", t);
    t = next;
  }
  return out;
}

PipeSimulation simulate(const PipeSchedule& sched, const PipeScheduleConfig& cfg,
                        const PipeCosts& c) {
  check(cfg);
  const int P = cfg.stages, M = cfg.micro_batches, K = P * cfg.virtual_chunks;
  if (static_cast<int>(sched.size()) != P)
    throw std::logic_error(fmt::format("a schedule of {} stages for {}", sched.size(), P));
  // Each action of the step exactly once, on the stage that owns its chunk.
  std::vector<int> seen(static_cast<std::size_t>(K) * M * 4, 0);
  std::size_t expected = 0;
  for (int s = 0; s < P; ++s)
    for (const PipeAction& a : sched[s]) {
      if (a.chunk < 0 || a.chunk >= K || a.chunk % P != s || a.micro_batch < 0 ||
          a.micro_batch >= M)
        throw std::logic_error(fmt::format("stage {} lists {}", s, describe({a})));
      ++seen[(static_cast<std::size_t>(a.chunk) * M + a.micro_batch) * 4 +
             static_cast<int>(a.op)];
      ++expected;
    }
  for (int k = 0; k < K; ++k)
    for (int m = 0; m < M; ++m) {
      const int* n = &seen[(static_cast<std::size_t>(k) * M + m) * 4];
      const bool whole = n[1] == 1 && n[2] == 0 && n[3] == 0;
      const bool split = n[1] == 0 && n[2] == 1 && n[3] == 1;
      if (n[0] != 1 || !(whole || split))
        throw std::logic_error(fmt::format("chunk {} micro-batch {}: F x{}, B x{}, I x{}, W x{}", k,
                                           m, n[0], n[1], n[2], n[3]));
    }
  Finish fin(K, M);
  std::vector<std::size_t> next(P, 0);
  std::vector<double> free_at(P, 0.0), busy(P, 0.0);
  std::size_t done = 0;
  while (done < expected) {
    bool progress = false;
    for (int s = 0; s < P; ++s) {
      if (next[s] == sched[s].size()) continue;
      const PipeAction& a = sched[s][next[s]];
      const double ready = ready_at(a, fin, K);
      if (ready == kNever) continue;  // waits for an action not yet placed
      const double start = std::max(ready, free_at[s]), cost = cost_of(a.op, c);
      record(a, start + cost, fin);
      free_at[s] = start + cost;
      busy[s] += cost;
      ++next[s], ++done, progress = true;
    }
    if (!progress) {
      std::string stuck;
      for (int s = 0; s < P; ++s)
        if (next[s] < sched[s].size())
          stuck += fmt::format(" stage {} at {};", s, describe({sched[s][next[s]]}));
      throw std::logic_error("the pipeline schedule deadlocks:" + stuck);
    }
  }
  PipeSimulation r;
  for (double f : free_at) r.makespan = std::max(r.makespan, f);
  double all = 0;
  for (double b : busy) all += b;
  r.bubble = r.makespan > 0 ? 1.0 - all / (P * r.makespan) : 0.0;
  return r;
}

std::string describe(const std::vector<PipeAction>& stage) {
  std::string out;
  for (const PipeAction& a : stage) {
    const char* op = a.op == PipeOp::kForward         ? "F"
                     : a.op == PipeOp::kBackward      ? "B"
                     : a.op == PipeOp::kBackwardInput ? "I"
                                                      : "W";
    out += fmt::format("{}{}{}.{}", out.empty() ? "" : " ", op, a.chunk, a.micro_batch);
  }
  return out;
}

PipeScheduleConfig schedule_config(const MeshShape& mesh, int micro_batches) {
  PipeScheduleConfig c;
  c.stages = mesh.pp;
  c.micro_batches = micro_batches;
  c.virtual_chunks = mesh.pp_chunks;
  if (mesh.pp_schedule == "zb-h1") {
    c.split_backward = true;
    c.max_weights_waiting = mesh.pp;
  }
  return c;
}

const char* schedule_name(const MeshShape& mesh) {
  const bool split = mesh.pp_schedule == "zb-h1", interleaved = mesh.pp_chunks > 1;
  if (split) return interleaved ? "interleaved ZB-H1" : "ZB-H1";
  return interleaved ? "interleaved 1F1B" : "1F1B";
}

int activation_slots(const std::vector<PipeAction>& actions, int chunk) {
  int now = 0, peak = 1;
  for (const PipeAction& a : actions) {
    if (a.chunk != chunk) continue;
    if (a.op == PipeOp::kForward) peak = std::max(peak, ++now);
    if (a.op == PipeOp::kBackward || a.op == PipeOp::kBackwardWeight) --now;
  }
  return peak;
}

std::vector<int> split_layers(int layers, int stages, double layer_cost, double first_extra,
                              double last_extra) {
  if (stages < 1 || stages > layers)
    throw std::invalid_argument("split_layers: " + std::to_string(stages) + " stages for " +
                                std::to_string(layers) + " layers");
  // The cost of stage s running n layers.
  auto cost = [&](int s, int n) {
    return n * layer_cost + (s == 0 ? first_extra : 0) + (s == stages - 1 ? last_extra : 0);
  };
  // best[s][i]: stages 0..s-1 over layers [0, i), the least (largest stage cost, sum of squared
  // stage costs: the evenest among equals); from[s][i]: where stage s - 1 began.
  struct Score {
    double worst = 0, squares = 0;
    bool operator<(const Score& o) const {
      return worst < o.worst || (worst == o.worst && squares < o.squares);
    }
  };
  const Score none{std::numeric_limits<double>::infinity(), 0};
  std::vector<std::vector<Score>> best(stages + 1, std::vector<Score>(layers + 1, none));
  std::vector<std::vector<int>> from(stages + 1, std::vector<int>(layers + 1, -1));
  best[0][0] = {0, 0};
  for (int s = 0; s < stages; ++s)
    for (int j = s + 1; j <= layers; ++j)
      // Stage s runs [i, j); i from the top, so that among equals earlier stages run more.
      for (int i = j - 1; i >= s; --i) {
        if (best[s][i].worst == none.worst) continue;
        const double c = cost(s, j - i);
        const Score x{std::max(best[s][i].worst, c), best[s][i].squares + c * c};
        if (x < best[s + 1][j]) best[s + 1][j] = x, from[s + 1][j] = i;
      }
  std::vector<int> b(stages + 1, layers);
  for (int s = stages; s > 0; --s) b[s - 1] = from[s][b[s]];
  return b;
}

std::vector<int> layer_bounds_from_counts(const std::string& counts, int chunks, int layers) {
  std::vector<int> b = {0};
  std::size_t start = 0;
  while (start <= counts.size()) {
    const std::size_t comma = std::min(counts.find(',', start), counts.size());
    const std::string item = ini::trim(counts.substr(start, comma - start));
    std::size_t used = 0;
    int n = 0;
    try {
      n = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || n < 1)
      throw std::invalid_argument(fmt::format("'{}' is not a positive layer count", item));
    b.push_back(b.back() + n);
    start = comma + 1;
  }
  if (static_cast<int>(b.size()) - 1 != chunks)
    throw std::invalid_argument(fmt::format("gives {} stage layer counts for {} chunks",
                                            b.size() - 1, chunks));
  if (b.back() != layers)
    throw std::invalid_argument(
        fmt::format("gives {} layers in all, the model has {}", b.back(), layers));
  return b;
}

}  // namespace qt
