// The layouts of `qtrain plan` (layouts.h).
#include "plan/layouts.h"

#include <fmt/format.h>

#include <algorithm>
#include <tuple>
#include <utility>

#include "parallel/tensor_parallel.h"
#include "qtrain/error.h"

namespace qt::plan {

namespace {

std::vector<int> divisors(int n) {
  std::vector<int> out;
  for (int d = 1; d <= n; ++d)
    if (n % d == 0) out.push_back(d);
  return out;
}

bool allowed(const std::vector<int>& sizes, int v) {
  return sizes.empty() || std::find(sizes.begin(), sizes.end(), v) != sizes.end();
}

// Why the mesh (dp, tp, pp) cannot run the search's model and batch, or "".
std::string why_not(const LayoutSearch& s, int dp, int tp, int pp) {
  const ModelConfig& m = s.model;
  if (const auto miss = tp_split_miss(m, tp))
    return fmt::format("mesh.tp = {} does not divide {} = {}", tp, miss->key, miss->n);
  const int G = s.topology.gpus_per_host;
  if (tp > G)
    return fmt::format("mesh.tp = {} is more than the {} GPUs of one host "
                       "(topology.gpus_per_host, --gpus-per-host)", tp, G);
  if (s.gpus > G && G % tp != 0)
    return fmt::format("mesh.tp = {} groups would straddle hosts of {} GPUs "
                       "(topology.gpus_per_host)", tp, G);
  if (pp > m.num_layers)
    return fmt::format("mesh.pp = {} is more than model.num_layers = {}", pp, m.num_layers);
  if (pp > 1 && pp * s.pp_chunks > m.num_layers)
    return fmt::format("mesh.pp x mesh.pp_chunks = {} chunks is more than model.num_layers = {}",
                       pp * s.pp_chunks, m.num_layers);
  const long long per_step = static_cast<long long>(s.micro_batch) * dp;
  if (s.global_batch % per_step != 0)
    return fmt::format("train.global_batch = {} is not a multiple of train.micro_batch x "
                       "mesh.dp = {} x {}", s.global_batch, s.micro_batch, dp);
  const long long M = s.global_batch / per_step;
  if (pp > 1 && M < pp)
    return fmt::format("{} micro-batch{} a step (train.global_batch / (train.micro_batch x "
                       "mesh.dp)) for mesh.pp = {} stages: fewer than the stages", M,
                       M == 1 ? "" : "es", pp);
  if (pp > 1 && s.pp_chunks > 1 && M % pp != 0)
    return fmt::format("{} micro-batches a step: interleaving (mesh.pp_chunks = {}) needs a "
                       "multiple of mesh.pp = {}", M, s.pp_chunks, pp);
  return "";
}

// Smaller is simpler: no offload, fewer pipeline stages, fewer tp ranks, the lower ZeRO stage,
// no recompute.
auto simplicity(const Layout& r) {
  return std::make_tuple(r.in.offload == Offload::kCpu, r.in.mesh.pp, r.in.mesh.tp,
                         r.in.mesh.ep, r.in.zero_stage, r.in.recompute);
}

}  // namespace

Layouts enumerate_layouts(const LayoutSearch& s) {
  if (s.gpus < 1) fail_user("--gpus {}: at least one GPU", s.gpus);
  Layouts out;
  for (int tp : divisors(s.gpus)) {
    if (!allowed(s.tp, tp)) continue;
    for (int pp : divisors(s.gpus / tp)) {
      if (!allowed(s.pp, pp)) continue;
      const int dp = s.gpus / tp / pp;
      if (std::string why = why_not(s, dp, tp, pp); !why.empty()) {
        out.excluded.push_back({dp, tp, pp, 1, std::move(why)});
        continue;
      }
      MemoryPlanInput in;
      in.model = s.model;
      in.micro_batch = s.micro_batch;
      in.seq_len = s.seq_len;
      in.mesh.dp = dp;
      in.mesh.tp = tp;
      in.mesh.pp = pp;
      if (pp > 1) {
        in.mesh.pp_schedule = s.pp_schedule;
        in.mesh.pp_chunks = s.pp_chunks;
      }
      in.sequence_parallel = s.sequence_parallel && tp > 1;
      in.micro_batches = static_cast<int>(s.global_batch / (static_cast<long long>(s.micro_batch) * dp));
      // Qwen3-MoE: each expert-parallel size; those the deck refuses are left out with why.
      std::vector<int> eps = {1};
      if (s.model.is_moe()) {
        eps.clear();
        for (int ep : s.ep.empty() ? divisors(dp) : s.ep) {
          const int E = s.model.num_experts;
          if (dp % ep != 0)
            out.excluded.push_back({dp, tp, pp, ep, fmt::format("mesh.ep = {} does not divide "
                                                                "mesh.dp = {}", ep, dp)});
          else if (E % ep != 0)
            out.excluded.push_back({dp, tp, pp, ep, fmt::format("mesh.ep = {} does not divide "
                                                                "model.num_experts = {}", ep, E)});
          else
            eps.push_back(ep);
        }
      }
      for (int ep : eps) {
        in.mesh.ep = ep;
        for (Offload off : {Offload::kNone, Offload::kCpu})
          for (int zero = 0; zero <= 3; ++zero)
            for (bool recompute : {false, true}) {
              if (off == Offload::kCpu && zero < 2) continue;  // the CUDA back end's rule
              // At dp 1 every ZeRO stage is the same run: ZeRO-0, and ZeRO-2 with offload.
              if (dp == 1 && zero != (off == Offload::kCpu ? 2 : 0)) continue;
              // ZB-H1 keeps activations for the weight halves, and a unit's gradients until its
              // last weight half (at dp 1 ZeRO-2/3 keep them whole: offload's rows).
              if (pp > 1 && in.mesh.pp_schedule == "zb-h1" &&
                  (recompute || (zero >= 2 && dp > 1))) {
                ++out.settings_skipped;
                continue;
              }
              Layout r;
              r.in = in;
              r.in.zero_stage = zero;
              r.in.offload = off;
              r.in.recompute = recompute;
              r.in.grad_reduce_bf16 = s.grad_reduce_bf16 && zero <= 1;
              r.memory = memory_plan(r.in);
              r.time = step_time(r.in, s.topology);
              r.fits = r.memory.device() <= s.usable;
              out.rows.push_back(std::move(r));
            }
      }
    }
  }
  std::stable_sort(out.rows.begin(), out.rows.end(), [](const Layout& a, const Layout& b) {
    if (a.fits != b.fits) return a.fits;
    if (a.time.total != b.time.total) return a.time.total < b.time.total;
    return simplicity(a) < simplicity(b);
  });
  return out;
}

const Layout* recommended(const Layouts& layouts, bool built_only) {
  auto candidate = [built_only](const Layout& r) { return r.fits && (!built_only || r.memory.built); };
  const Layout* fastest = nullptr;
  for (const Layout& r : layouts.rows)
    if (candidate(r) && (!fastest || r.time.total < fastest->time.total)) fastest = &r;
  if (!fastest) return nullptr;
  const Layout* best = fastest;
  for (const Layout& r : layouts.rows)
    if (candidate(r) && r.time.total <= 1.01 * fastest->time.total &&
        simplicity(r) < simplicity(*best))
      best = &r;
  return best;
}

std::vector<std::string> deck_keys(const Layout& r) {
  const MeshShape& m = r.in.mesh;
  std::vector<std::string> out = {fmt::format("mesh.dp = {}", m.dp),
                                  fmt::format("mesh.tp = {}", m.tp),
                                  fmt::format("mesh.pp = {}", m.pp)};
  if (r.in.model.is_moe()) out.push_back(fmt::format("mesh.ep = {}", m.ep));
  if (m.pp > 1) {
    out.push_back(fmt::format("mesh.pp_schedule = {}", m.pp_schedule));
    out.push_back(fmt::format("mesh.pp_chunks = {}", m.pp_chunks));
  }
  if (r.in.sequence_parallel) out.push_back("mesh.sequence_parallel = true");
  out.push_back(fmt::format("train.recompute = {}", r.in.recompute ? "true" : "false"));
  out.push_back(fmt::format("optim.zero_stage = {}", r.in.zero_stage));
  out.push_back(fmt::format("optim.offload = {}", offload_name(r.in.offload)));
  return out;
}

}  // namespace qt::plan
