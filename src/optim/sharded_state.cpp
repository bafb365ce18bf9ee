// The optimizer driver over ZeRO stages 0-3 (see sharded_state.h).
#include "optim/sharded_state.h"

#include <algorithm>
#include <cmath>

#include "optim/adamw_math.h"
#include "optim/schedule.h"
#include "qtrain/error.h"

namespace qt {

namespace {
void free_vector(std::vector<float>& x) { std::vector<float>().swap(x); }
double bytes_of(const std::vector<float>& x) { return 4.0 * static_cast<double>(x.size()); }
}  // namespace

ShardedState::ShardedState(const ShardPlan& plan, const ParamLayout& layout,
                           const OptimConfig& cfg, Comm& dp, int total_steps, Comm* tp,
                           const PipelineShare* pipe, Comm* edp)
    : plan_(plan),
      layout_(layout),
      cfg_(cfg),
      dp_(dp),
      tp_(plan.tp > 1 ? tp : nullptr),
      edp_(edp),
      total_steps_(total_steps),
      zero_(plan.zero_stage) {
  QT_CHECK(plan.dp == dp.size(), "plan for dp {} on a dp communicator of {}", plan.dp, dp.size());
  QT_CHECK(plan.tp == 1 || (tp != nullptr && tp->size() == plan.tp),
           "plan for tp {} without a tp communicator of that size", plan.tp);
  for (const ParamUnit& u : plan.units)
    QT_CHECK(u.group == MeshDim::kDp || (u.group == MeshDim::kEdp && edp && edp->size() == u.dp),
             "unit {} over {} ranks of {} without that communicator", u.name, u.dp,
             mesh_dim_name(u.group));
  units_.resize(plan_.units.size());
  held_.assign(units_.size(), pipe ? 0 : 1);
  if (pipe) {
    pp_ = pipe->pp;
    copy_ = pipe->copy;
    for (int u : pipe->held) {
      QT_CHECK(u >= 0 && u < static_cast<int>(units_.size()), "held unit {}", u);
      held_[u] = 1;
    }
    QT_CHECK(copy_ < 0 || held_[copy_], "the tied copy {} is not held", copy_);
  }
  for (std::size_t i = 0; i < units_.size(); ++i) {
    if (!held(i)) continue;
    const ParamUnit& pu = plan_.units[i];
    Unit& u = units_[i];
    const std::size_t own = pu.shard(rank(i)).size();
    u.params.assign(zero_ == 3 ? pu.chunk : pu.padded(), 0.0f);
    if (zero_ <= 1) u.grads.assign(pu.padded(), 0.0f);
    if (zero_ >= 1) u.grad_shard.assign(pu.chunk, 0.0f);
    u.m.assign(zero_ == 0 ? pu.range.size() : own, 0.0f);
    u.v.assign(u.m.size(), 0.0f);
  }
  note_peak();
}

const float* ShardedState::params(int u) {
  if (zero_ < 3) return units_[u].params.data();
  QT_CHECK(!units_[u].gathered.empty(), "unit {} used before acquire()", plan_.units[u].name);
  return units_[u].gathered.data();
}

float* ShardedState::grads(int u) {
  Unit& x = units_[u];
  if (zero_ >= 2 && x.grads.empty()) {  // this micro-batch's scratch for the unit
    x.grads.assign(plan_.units[u].padded(), 0.0f);
    note_peak();
  }
  return x.grads.data();
}

void ShardedState::acquire(int u) {
  Unit& x = units_[u];
  if (zero_ < 3 || !x.gathered.empty()) return;  // held already (the head, a tied embedding)
  const ParamUnit& pu = plan_.units[u];
  x.gathered.resize(pu.padded());
  group(u).all_gather(x.params.data(), x.gathered.data(), pu.chunk, DType::kF32);
  note_peak();
}

void ShardedState::release(int u) {
  if (zero_ == 3) free_vector(units_[u].gathered);
}

void ShardedState::grads_done(int u) {
  if (zero_ < 2) return;
  Unit& x = units_[u];
  QT_CHECK(!x.grads.empty(), "grads_done() of unit {} without gradients", plan_.units[u].name);
  reduce_partial_over_tp(u, x.grads.data());
  // This micro-batch's gradients of the unit, summed over its group, added to the own shard's.
  const std::size_t chunk = plan_.units[u].chunk;
  reduced_.resize(std::max(reduced_.size(), chunk));
  group(u).reduce_scatter(x.grads.data(), reduced_.data(), chunk, DType::kF32, ReduceOp::kSum);
  for (std::size_t i = 0; i < chunk; ++i) x.grad_shard[i] += reduced_[i];
  free_vector(x.grads);
}

void ShardedState::zero_grads() {
  for (Unit& x : units_) {
    std::fill(x.grads.begin(), x.grads.end(), 0.0f);
    std::fill(x.grad_shard.begin(), x.grad_shard.end(), 0.0f);
  }
}

Range ShardedState::updated(int u) const {
  return zero_ == 0 ? plan_.units[u].range : plan_.units[u].shard(rank(u));
}

float* ShardedState::updated_params(int u) {
  const ParamUnit& pu = plan_.units[u];
  if (zero_ == 3) return units_[u].params.data();
  return units_[u].params.data() + (updated(u).begin - pu.range.begin);
}

const float* ShardedState::updated_grads(int u) {
  return zero_ == 0 ? units_[u].grads.data() : units_[u].grad_shard.data();
}

void ShardedState::update(int u, const AdamWStep& s) {
  const Range r = updated(u);
  float* w = updated_params(u);
  const float* g = updated_grads(u);
  Unit& x = units_[u];
  const auto& ps = layout_.params();
  // Each tensor overlapping r, so that weight decay follows the tensor's flag.
  for (std::size_t t : plan_.units[u].params) {
    const ParamInfo& p = ps[t];
    const std::size_t lo = std::max(r.begin, p.offset), hi = std::min(r.end, p.offset + p.numel);
    if (lo >= hi) continue;
    const std::size_t j = lo - r.begin;
    adamw_update(w + j, g + j, x.m.data() + j, x.v.data() + j, hi - lo, s, p.weight_decay);
  }
}

OptimStepStats ShardedState::step(const StepRequest& request) {
  OptimStepStats st;
  st.lr = lr_at(cfg_, total_steps_, request.step);
  // 1. Reduce: every rank ends with the summed gradients of what it updates.
  for (std::size_t u = 0; u < units_.size(); ++u) {
    if (!held(u)) continue;
    Unit& x = units_[u];
    if (zero_ <= 1) reduce_partial_over_tp(static_cast<int>(u), x.grads.data());
    if (zero_ == 0 && group(u).size() > 1)
      group(u).all_reduce(x.grads.data(), plan_.units[u].range.size(), DType::kF32,
                          ReduceOp::kSum);
    if (zero_ == 1)
      group(u).reduce_scatter(x.grads.data(), x.grad_shard.data(), x.grad_shard.size(), DType::kF32,
                         ReduceOp::kSum);
  }
  // 2. The global norm: each element once, summed by its owner (an expert unit's owners over dp
  // are its ep ranks' expert-dp owners, each of its own experts).
  double sumsq = 0;
  for (std::size_t u = 0; u < units_.size(); ++u) {
    if (!held(u) || static_cast<int>(u) == copy_) continue;  // a tied copy: its original counts
    const ParamUnit& pu = plan_.units[u];
    const Range own = pu.shard(rank(u));
    const float* g = zero_ == 0 ? units_[u].grads.data() + (own.begin - pu.range.begin)
                                : units_[u].grad_shard.data();
    sumsq += sum_squares(static_cast<int>(u), own, g);
  }
  sumsq = dp_.sum(sumsq);
  if (tp_) sumsq = tp_->sum(sumsq);
  if (pp_) sumsq = pp_->sum(sumsq);
  // A non-finite loss or norm (summed over the mesh: the same on every rank) skips the update;
  // the parameters, their whole copies and the moments stay as they were.
  judge_gradients(st, sumsq, request, cfg_.grad_clip);
  if (st.skipped) return st;
  // 3. Update the owned elements, then share them where the parameters are whole.
  const AdamWStep s = adamw_step(cfg_, st.lr, st.clip_scale, request.update);
  for (std::size_t u = 0; u < units_.size(); ++u) {
    if (!held(u)) continue;
    update(static_cast<int>(u), s);
    if ((zero_ == 1 || zero_ == 2) && group(u).size() > 1) {
      const ParamUnit& pu = plan_.units[u];
      float* whole = units_[u].params.data();  // rank r's shard already sits at r * chunk
      group(u).all_gather(whole + pu.chunk * rank(u), whole, pu.chunk, DType::kF32);
    }
  }
  return st;
}

void ShardedState::reduce_partial_over_tp(int u, float* grads) {
  if (!tp_) return;
  const ParamUnit& pu = plan_.units[u];
  for (std::size_t i : pu.params) {
    const ShardSpec& spec = plan_.specs[i];
    if (spec.partial_over.empty()) continue;
    const ParamInfo& p = layout_.params()[i];
    float* g = grads + (p.offset - pu.range.begin);
    if (spec.tp_replicas == 1) {
      tp_->all_reduce(g, p.numel, DType::kF32, ReduceOp::kSum);
      continue;
    }
    // Summed over the group of tp ranks sharing these rows only, in rank order (the same bits
    // on each of them): every rank's copy, gathered. Cost: tp copies of the tensor (one kv
    // head's [head_dim, H]) move and sit in scratch where a group communicator would move
    // tp_replicas; small beside the layer's all-reduces.
    const std::size_t n = p.numel;
    std::vector<float> all(n * static_cast<std::size_t>(tp_->size()));
    tp_->all_gather(g, all.data(), n, DType::kF32);
    const std::size_t first = static_cast<std::size_t>(tp_->rank() / spec.tp_replicas *
                                                       spec.tp_replicas);
    for (std::size_t k = 0; k < n; ++k) {
      float sum = 0;
      for (std::size_t j = 0; j < static_cast<std::size_t>(spec.tp_replicas); ++j)
        sum += all[(first + j) * n + k];
      g[k] = sum;
    }
  }
}

double ShardedState::sum_squares(int u, Range own, const float* g) const {
  const ParamUnit& pu = plan_.units[u];
  double sumsq = 0;
  for (std::size_t i : pu.params) {
    const ParamInfo& p = layout_.params()[i];
    const std::size_t lo = std::max(own.begin, p.offset);
    const std::size_t hi = std::min(own.end, p.offset + p.numel);
    if (lo >= hi) continue;
    // A copy replicated over tp: counted by tp rank 0 only; one shared by a group of tp ranks
    // (tp_replicas) by the group's first.
    if (tp_ && tp_->rank() != 0 && plan_.specs[i].replicated_over_dim(MeshDim::kTp)) continue;
    if (tp_ && tp_->rank() % plan_.specs[i].tp_replicas != 0) continue;
    for (std::size_t k = lo; k < hi; ++k) {
      const double x = g[k - own.begin];
      sumsq += x * x;
    }
  }
  return sumsq;
}

std::vector<FlatPiece> ShardedState::param_pieces() {
  std::vector<FlatPiece> out;
  for (std::size_t u = 0; u < units_.size(); ++u) {
    if (!held(u)) continue;
    const ParamUnit& pu = plan_.units[u];
    const Range r = zero_ == 3 ? pu.shard(rank(u)) : pu.range;
    if (r.size() > 0) out.push_back({r, units_[u].params.data()});
  }
  return out;
}

std::vector<StatePiece> ShardedState::checkpoint_pieces() {
  std::vector<StatePiece> out;
  for (std::size_t u = 0; u < units_.size(); ++u) {
    if (!held(u) || static_cast<int>(u) == copy_) continue;  // a tied copy: the original writes
    const ParamUnit& pu = plan_.units[u];
    const Range own = pu.shard(rank(u));
    if (own.size() == 0) continue;
    const std::size_t in_unit = own.begin - pu.range.begin;
    const Unit& x = units_[u];
    const std::size_t in_moments = zero_ == 0 ? in_unit : 0;
    out.push_back({own, x.params.data() + (zero_ == 3 ? 0 : in_unit), x.m.data() + in_moments,
                   x.v.data() + in_moments});
  }
  return out;
}

StateTargets ShardedState::checkpoint_targets() {
  StateTargets t;
  t.params = param_pieces();
  for (std::size_t u = 0; u < units_.size(); ++u) {
    const Range r = updated(static_cast<int>(u));
    if (!held(u) || r.size() == 0) continue;
    t.exp_avg.push_back({r, units_[u].m.data()});
    t.exp_avg_sq.push_back({r, units_[u].v.data()});
  }
  return t;
}

StateBytes ShardedState::bytes() const {
  StateBytes b;
  for (const Unit& x : units_) {
    b.params += bytes_of(x.params) + bytes_of(x.gathered);
    b.grads += bytes_of(x.grads) + bytes_of(x.grad_shard);
    b.optimizer += bytes_of(x.m) + bytes_of(x.v);
  }
  return b;
}

void ShardedState::note_peak() {
  const StateBytes b = bytes();
  peak_.params = std::max(peak_.params, b.params);
  peak_.grads = std::max(peak_.grads, b.grads);
  peak_.optimizer = std::max(peak_.optimizer, b.optimizer);
}

}  // namespace qt
