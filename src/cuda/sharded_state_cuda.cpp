// The CUDA optimizer driver: ZeRO 0-3 and offload (see sharded_state_cuda.h).
#include "cuda/sharded_state_cuda.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <thread>

#include "cuda/check.h"
#include "parallel/unit_order.h"
#include "ops/cuda/convert.cuh"
#include "ops/cuda/embedding.cuh"
#include "optim/schedule.h"
#include "qtrain/error.h"

namespace qt::cuda {

namespace {
constexpr int kWeightSlots = 3;  // the unit in use, the next one, one prefetched
constexpr int kGradSlots = 2;    // the unit in its backward, the previous one being reduced
constexpr std::size_t kHostSlice = std::size_t{1} << 20;  // elements per host AdamW task

}  // namespace

ShardedCudaState::ShardedCudaState(const ShardPlan& plan, const ParamLayout& layout,
                                   const OptimConfig& cfg, MpiComm& dp, NcclComm* nccl,
                                   DeviceArena& arena, unsigned host_threads, EmbeddingRows rows,
                                   TpComms tp, PipelineHold pipe, NcclComm* edp)
    : plan_(plan),
      layout_(layout),
      cfg_(cfg),
      offload_(cfg.offload == "cpu"),
      zero_(plan.zero_stage),
      rank_(dp.rank()),
      dp_(dp),
      nccl_(nccl),
      edp_(edp),
      tp_(plan.tp > 1 ? tp : TpComms{}),
      pp_(pipe.pp),
      uncounted_(pipe.uncounted),
      host_threads_(std::max(1u, host_threads)) {
  QT_CHECK(zero_ >= 0 && zero_ <= 3, "ZeRO stage {}", zero_);
  QT_CHECK(!offload_ || zero_ >= 2, "offload needs ZeRO-2 or 3, not {}", zero_);
  QT_CHECK(plan.dp == dp.size() && (nccl != nullptr) == (dp.size() > 1),
           "plan for dp {} on {} ranks (NCCL {})", plan.dp, dp.size(), nccl != nullptr);
  QT_CHECK(plan.tp == 1 || (tp_.host && tp_.device && tp_.host->size() == plan.tp &&
                            tp_.device->size() == plan.tp),
           "plan for tp {} without tp communicators of that size", plan.tp);
  QT_CHECK(pipe.held.empty() || nccl == nullptr || zero_ <= 1,
           "a pipeline stage's state at dp {} with ZeRO-{} (the deck checks it)", plan.dp, zero_);
  for (const ShardSpec& s : plan.specs) {
    QT_CHECK(s.tp_replicas == 1 || (tp_.device && tp_.device->size() % s.tp_replicas == 0),
             "kv heads shared by {} tp ranks without a tp group of a multiple of that size",
             s.tp_replicas);
    kv_replicas_ = std::max(kv_replicas_, s.tp_replicas);
  }
  for (const ParamUnit& pu : plan.units)
    QT_CHECK(pu.group == MeshDim::kDp ||
                 (pu.group == MeshDim::kEdp && nccl != nullptr && edp && edp->size() == pu.dp),
             "expert unit {} over an edp group of {} ranks, communicator of {} (dp {})", pu.name,
             pu.dp, edp ? edp->size() : 0, plan.dp);
  // ZeRO-3's gather ring prefetches along the forward's order of the units (a layer's experts'
  // unit, after the head in the plan, right after its layer), the backward's in reverse.
  order_ = forward_unit_order(plan_);
  order_at_.assign(plan_.units.size(), 0);
  for (std::size_t i = 0; i < order_.size(); ++i) order_at_[order_[i]] = static_cast<int>(i);
  bool expert_units = false;
  for (const ParamUnit& pu : plan.units) expert_units |= pu.group == MeshDim::kEdp;
  auto held = [&pipe](std::size_t u) {
    return pipe.held.empty() ||
           std::binary_search(pipe.held.begin(), pipe.held.end(), static_cast<int>(u));
  };
  std::vector<AdamWSegment> segs;
  for (const ParamInfo& p : layout.params())
    segs.push_back({p.offset, p.offset + p.numel, p.weight_decay ? 1 : 0});
  const std::size_t start = arena.used();
  segments_ = arena.allocate<AdamWSegment>(segs.size());
  num_segments_ = static_cast<int>(segs.size());
  upload(segments_, segs.data(), segs.size() * sizeof(segs[0]));
  norm_ws_ = arena.allocate(grad_norm_workspace_bytes());
  scatter_norm_ws_ = arena.allocate(grad_norm_workspace_bytes());
  if (edp_) edp_norm_ws_ = arena.allocate(grad_norm_workspace_bytes());
  reduced_.assign(plan_.units.size(), 0);
  summed_.assign(plan_.units.size(), 0);

  std::size_t max_chunk = 1, max_padded = 1;  // over the units after the embedding
  std::size_t all_padded = 1;                   // over every unit
  units_.resize(plan_.units.size());
  for (std::size_t i = 0; i < units_.size(); ++i) {
    const ParamUnit& pu = plan_.units[i];
    Unit& u = units_[i];
    if (!held(i)) {  // another stage's: no elements here
      u.held = false;
      u.shard = u.own = Range{pu.range.begin, pu.range.begin};
      continue;
    }
    u.shard = pu.shard(group_rank(static_cast<int>(i)));
    u.own = zero_ == 0 ? pu.range : u.shard;
    const std::size_t nw = gathers() ? pu.chunk : pu.padded();
    std::size_t mark = arena.used();
    u.weights = arena.allocate<bf16>(nw);
    bytes_.params += static_cast<double>(arena.used() - mark);
    mark = arena.used();
    QT_CHECK_CUDA(cudaMemset(u.weights, 0, nw * sizeof(bf16)));  // padding stays zero
    if (!offload_) {
      const std::size_t nm = zero_ == 0 ? pu.range.size() : pu.chunk;
      u.master = arena.allocate<float>(nm);
      u.m = arena.allocate<float>(u.own.size());
      u.v = arena.allocate<float>(u.own.size());
      QT_CHECK_CUDA(cudaMemset(u.master, 0, nm * sizeof(float)));
      QT_CHECK_CUDA(cudaMemset(u.m, 0, u.own.size() * sizeof(float)));
      QT_CHECK_CUDA(cudaMemset(u.v, 0, u.own.size() * sizeof(float)));
    }
    bytes_.optimizer += static_cast<double>(arena.used() - mark);
    mark = arena.used();
    const std::size_t ng = whole_grads() ? pu.padded() : pu.chunk;
    u.grad = arena.allocate<float>(ng);
    bytes_.grads += static_cast<double>(arena.used() - mark);
    QT_CHECK_CUDA(cudaMemset(u.grad, 0, ng * sizeof(float)));
    u.host_master.assign(u.own.size(), 0.0f);
    u.host_m.assign(u.own.size(), 0.0f);
    u.host_v.assign(u.own.size(), 0.0f);
    all_padded = std::max(all_padded, pu.padded());
    if (i > 0) {
      max_chunk = std::max(max_chunk, pu.chunk);
      max_padded = std::max(max_padded, pu.padded());
    }
  }
  // What the norm counts of each shard, and what tp sums of each own range.
  const bool count_replicated = tp_.host == nullptr || tp_.host->rank() == 0;
  const int tp_rank = tp_.host ? tp_.host->rank() : 0;
  std::size_t sums = 0, max_shared = 0;
  for (std::size_t i = 0; i < units_.size(); ++i) {
    const Unit& u = units_[i];
    sumsq_at_.push_back(sums);
    counted_.push_back(!u.held || static_cast<int>(i) == pipe.uncounted ? std::vector<Range>{}
                       : count_replicated
                           ? std::vector<Range>{Range{0, u.shard.size()}}
                           : tensor_ranges(u.shard, [tp_rank](const ShardSpec& x) {
                               // a kv head's rows: by the first of the ranks sharing it
                               return !x.replicated_over_dim(MeshDim::kTp) &&
                                      tp_rank % x.tp_replicas == 0;
                             }));
    sums += counted_.back().size();
    partial_.push_back(tp_.device ? tensor_ranges(u.own, [](const ShardSpec& x) {
                                      return !x.partial_over.empty() && x.tp_replicas == 1;
                                    })
                                  : std::vector<Range>{});
    shared_.push_back(tp_.device ? tensor_ranges(u.own, [](const ShardSpec& x) {
                                     return x.tp_replicas > 1;
                                   })
                                 : std::vector<Range>{});
    std::size_t n = 0;
    for (const Range& r : shared_.back()) n += r.size();
    max_shared = std::max(max_shared, n);
  }
  if (max_shared > 0)  // [tp, a unit's shared kv rows]: every tp rank's partial gradients
    shared_gathered_ =
        arena.allocate<float>(max_shared * static_cast<std::size_t>(tp_.device->size()));
  sumsq_at_.push_back(sums);
  unit_sumsq_ = arena.allocate<double>(std::max<std::size_t>(sums, 1));
  const ParamUnit& embed = plan_.units[0];
  weight_at_.assign(units_.size(), nullptr);
  grad_at_.assign(units_.size(), nullptr);
  std::size_t mark = arena.used();
  if (gathers()) {
    // A sparse layer holds its experts' unit beside its own and the next layer's (its norm):
    // one slot more keeps a prefetch going.
    for (int k = 0; k < kWeightSlots + (expert_units ? 1 : 0); ++k) {
      weight_ring_.push_back(std::make_unique<Slot>());
      weight_ring_.back()->data = arena.allocate<bf16>(max_padded);
    }
    embed_weights_.data = arena.allocate<bf16>(embed.padded());
  }
  bytes_.params += static_cast<double>(arena.used() - mark);
  mark = arena.used();
  if (scatters() && zero_ <= 1 && cfg_.grad_reduce == "bf16") {
    reduce_stage_ = arena.allocate<bf16>(all_padded);
    if (edp_) edp_stage_ = arena.allocate<bf16>(all_padded);
  }
  if (scatters() && zero_ >= 2) {
    for (int k = 0; k < kGradSlots; ++k) {
      grad_ring_.push_back(std::make_unique<Slot>());
      grad_ring_.back()->data = arena.allocate<float>(max_padded);
      grad_ring_.back()->reduced = arena.allocate<float>(max_chunk);
    }
    const std::size_t gathered = std::size_t(plan.dp) * rows.tokens;
    if (rows.tokens > 0 && gathered * rows.hidden < embed.range.size()) {
      QT_CHECK(rows.hidden > 0 && embed.range.size() % rows.hidden == 0,
               "the embedding unit ({} elements) is not rows of {}", embed.range.size(),
               rows.hidden);
      rows_ = rows;
      rows_ids_ = arena.allocate<std::int32_t>(gathered);
      rows_dx_ = arena.allocate<bf16>(gathered * rows.hidden);
      rows_ws_bytes_ = embedding_backward_workspace_bytes(static_cast<int>(gathered));
      rows_ws_ = arena.allocate(rows_ws_bytes_);
    } else {
      embed_grads_.data = arena.allocate<float>(embed.padded());
      embed_grads_.reduced = arena.allocate<float>(embed.chunk);
    }
  }
  bytes_.grads += static_cast<double>(arena.used() - mark);
  // The segment table and the norm's workspace: the optimizer's.
  bytes_.optimizer += static_cast<double>(arena.used() - start) - bytes_.total();
  if (offload_) {
    const std::size_t n = std::max(max_chunk, embed.chunk);
    for (int k = 0; k < 2; ++k) {
      stage_grads_[k] = PinnedBuffer(n * sizeof(float));
      stage_weights_[k] = PinnedBuffer(n * sizeof(bf16));
    }
  }
  QT_CHECK_CUDA(cudaDeviceSynchronize());
}

template <class Pick>
std::vector<Range> ShardedCudaState::tensor_ranges(Range within, Pick pick) const {
  std::vector<Range> out;
  for (std::size_t i = 0; i < layout_.params().size(); ++i) {
    const ParamInfo& p = layout_.params()[i];
    const std::size_t lo = std::max(within.begin, p.offset);
    const std::size_t hi = std::min(within.end, p.offset + p.numel);
    if (lo >= hi || !pick(plan_.specs[i])) continue;
    if (!out.empty() && out.back().end == lo - within.begin)
      out.back().end = hi - within.begin;
    else
      out.push_back({lo - within.begin, hi - within.begin});
  }
  return out;
}

std::string ShardedCudaState::describe() const {
  static const char* what[] = {
      "bf16 weights, fp32 gradients, master weights and AdamW moments whole on every rank",
      "bf16 weights and fp32 gradients whole, master weights and AdamW moments of the own shard",
      "bf16 weights whole; fp32 gradients, master weights and AdamW moments of the own shard",
      "bf16 weights (each unit gathered ahead of use), fp32 gradients, master weights and AdamW "
      "moments of the own shard"};
  std::string d = fmt::format("ZeRO-{} over dp {} in {} units: {}", zero_, plan_.dp,
                              plan_.units.size(), what[zero_]);
  if (plan_.tp > 1)
    d += fmt::format("; each tp rank's part of the tensors split over tp {} (gradients partial "
                     "over tp summed over it: q/k norms, every norm with sequence parallelism)",
                     plan_.tp);
  if (reduce_stage_ != nullptr) d += "; gradients reduced in bf16";
  if (rows_.tokens > 0)
    d += "; the untied embedding's gradient reduced as the micro-batch's rows";
  if (offload_)
    d += fmt::format("; offload: master weights and moments in host memory, AdamW on {} host "
                     "threads",
                     host_threads_);
  return d;
}

ShardedCudaState::Slot* ShardedCudaState::free_slot(std::vector<std::unique_ptr<Slot>>& ring) {
  Slot* best = nullptr;
  for (auto& s : ring)
    if (s->unit < 0 && (best == nullptr || s->freed < best->freed)) best = s.get();
  return best;
}

void ShardedCudaState::give_up(Slot& slot) {
  slot.unit = -1;
  slot.freed = ++releases_;
}

void ShardedCudaState::gather(int u, Slot& slot) {
  slot.unit = u;
  weight_at_[u] = &slot;
  NcclComm& c = comm(u);
  c.wait_event(slot.free.get());  // the slot's previous unit has been used for the last time
  c.all_gather_async(units_[u].weights, slot.data, plan_.units[u].chunk, DType::kBF16);
  slot.ready.record(c.stream());
}

void ShardedCudaState::prefetch_after(int u) {
  const int at = order_at_[u] + direction_;
  if (at < 0 || at >= static_cast<int>(order_.size())) return;
  const int next = order_[at];
  if (next < 1 || weight_at_[next] != nullptr) return;
  if (Slot* slot = free_slot(weight_ring_)) gather(next, *slot);
}

const bf16* ShardedCudaState::weights(int u, cudaStream_t s) {
  if (!gathers()) return units_[u].weights;
  Slot* slot = weight_at_[u];
  if (slot == nullptr) {
    slot = u == 0 ? &embed_weights_ : free_slot(weight_ring_);
    QT_CHECK(slot != nullptr, "no free gather slot for unit {}", plan_.units[u].name);
    gather(u, *slot);
  }
  QT_CHECK_CUDA(cudaStreamWaitEvent(s, slot->ready.get(), 0));
  prefetch_after(u);
  return static_cast<const bf16*>(slot->data);
}

void ShardedCudaState::release(int u, cudaStream_t s) {
  if (!gathers() || weight_at_[u] == nullptr) return;
  Slot& slot = *weight_at_[u];
  slot.free.record(s);
  give_up(slot);
  weight_at_[u] = nullptr;
}

float* ShardedCudaState::grads(int u, cudaStream_t s) {
  if (direction_ > 0) {  // the backward has begun: prefetch downwards from the head
    direction_ = -1;
    if (gathers()) prefetch_after(u);
  }
  if (whole_grads()) return units_[u].grad;
  Slot* slot = grad_at_[u];
  if (slot == nullptr) {
    slot = u == 0 ? &embed_grads_ : free_slot(grad_ring_);
    QT_CHECK(slot != nullptr && slot->data != nullptr, "no free gradient slot for unit {}",
             plan_.units[u].name);
    QT_CHECK_CUDA(cudaStreamWaitEvent(s, slot->free.get(), 0));  // its last reduction is done
    slot->unit = u;
    grad_at_[u] = slot;
  }
  return static_cast<float*>(slot->data);
}

void ShardedCudaState::grads_done(int u, cudaStream_t s) {
  if (!scatters()) return;
  if (zero_ <= 1) {  // whole gradients: reduced once, after the step's last micro-batch
    if (last_of_step_) reduce_whole(u, s);
    return;
  }
  Slot* slot = grad_at_[u];
  QT_CHECK(slot != nullptr, "grads_done() of unit {} without gradients", plan_.units[u].name);
  Unit& x = units_[u];
  const std::size_t chunk = plan_.units[u].chunk;
  NcclComm& c = comm(u);
  compute_done_.record(s);
  c.wait_event(compute_done_.get());
  if (!reduced_[u]) {  // the step's first reduction writes the shard: nothing to zero or add
    c.reduce_scatter_async(slot->data, x.grad, chunk, DType::kF32, ReduceOp::kSum);
    reduced_[u] = 1;
  } else {
    c.reduce_scatter_async(slot->data, slot->reduced, chunk, DType::kF32, ReduceOp::kSum);
    add_f32(x.grad, slot->reduced, chunk, c.stream());
  }
  slot->free.record(c.stream());
  give_up(*slot);
  grad_at_[u] = nullptr;
  if (last_of_step_)  // the shard is final: its norm overlaps the rest of the backward
    take_sum_of_squares(u, c.stream(), comm_norm_ws(u));
  else
    summed_[u] = 0;  // a later micro-batch changes the shard
}

void ShardedCudaState::reduce_whole(int u, cudaStream_t s) {
  Unit& x = units_[u];
  const ParamUnit& pu = plan_.units[u];
  NcclComm& c = comm(u);
  cudaStream_t ns = c.stream();
  compute_done_.record(s);
  c.wait_event(compute_done_.get());
  bf16* stage = comm_stage(u);
  const bool bf16_wire = stage != nullptr;
  void* buf = x.grad;
  if (bf16_wire) {
    convert_f32_to_bf16(stage, x.grad, pu.padded(), ns);
    buf = stage;
  }
  const DType t = bf16_wire ? DType::kBF16 : DType::kF32;
  const std::size_t at = x.shard.begin - pu.range.begin;  // = rank x chunk (or the unit's end)
  if (zero_ == 0) {
    c.all_reduce_async(buf, pu.range.size(), t, ReduceOp::kSum);
    if (bf16_wire) convert_bf16_to_f32(x.grad, stage, pu.range.size(), ns);
  } else {  // in place: rank r's reduced chunk lands at r x chunk
    char* b = static_cast<char*>(buf);
    const std::size_t es = dtype_size(t);
    c.reduce_scatter_async(b, b + pu.chunk * group_rank(u) * es, pu.chunk, t, ReduceOp::kSum);
    if (bf16_wire) convert_bf16_to_f32(x.grad + at, stage + at, x.shard.size(), ns);
  }
  reduced_[u] = 1;
  take_sum_of_squares(u, ns, comm_norm_ws(u));
}

bool ShardedCudaState::take_embedding_rows(const bf16* dx, const std::int32_t* ids, int N,
                                           cudaStream_t s) {
  if (rows_.tokens == 0) return false;
  QT_CHECK(N == rows_.tokens, "embedding rows of {} tokens, set up for {}", N, rows_.tokens);
  Unit& x = units_[0];
  const std::size_t n = std::size_t(N) * rows_.hidden;
  compute_done_.record(s);
  nccl_->wait_event(compute_done_.get());
  nccl_->all_gather_async(ids, rows_ids_, static_cast<std::size_t>(N), DType::kI32);
  nccl_->all_gather_async(dx, rows_dx_, n, DType::kBF16);
  rows_gathered_.record(nccl_->stream());
  // On the compute stream (the backward's last work): the own shard's rows of every rank's
  // tokens, in rank order, into the shard (from zero for the step's first micro-batch).
  QT_CHECK_CUDA(cudaStreamWaitEvent(s, rows_gathered_.get(), 0));
  if (!reduced_[0])
    QT_CHECK_CUDA(cudaMemsetAsync(x.grad, 0, plan_.units[0].chunk * sizeof(float), s));
  // The own range in the whole table's flat coordinates (ids are the whole vocabulary's).
  const std::size_t lo = x.own.begin - plan_.units[0].range.begin +
                         static_cast<std::size_t>(rows_.vocab_begin) * rows_.hidden;
  embedding_backward_range(x.grad, lo, lo + x.own.size(), rows_dx_, rows_ids_,
                           N * plan_.dp, rows_.hidden, rows_ws_, rows_ws_bytes_, s);
  reduced_[0] = 1;
  if (last_of_step_)
    take_sum_of_squares(0, s, norm_ws_);
  else
    summed_[0] = 0;
  return true;
}

Qwen3Cuda::GradWrite ShardedCudaState::begin_micro_batch(bool first_of_step, bool last_of_step) {
  direction_ = +1;
  last_of_step_ = last_of_step;
  return !whole_grads() || first_of_step ? Qwen3Cuda::GradWrite::kOverwrite
                                         : Qwen3Cuda::GradWrite::kAccumulate;
}

void ShardedCudaState::begin_step() {
  std::fill(reduced_.begin(), reduced_.end(), 0);
  std::fill(summed_.begin(), summed_.end(), 0);
}

void ShardedCudaState::clear_grads(cudaStream_t s) {
  for (std::size_t u = 0; u < units_.size(); ++u) {
    if (!units_[u].held) continue;
    const ParamUnit& pu = plan_.units[u];
    const std::size_t n = whole_grads() ? pu.padded() : pu.chunk;
    QT_CHECK_CUDA(cudaMemsetAsync(units_[u].grad, 0, n * sizeof(float), s));
  }
}

float* ShardedCudaState::own_grads(int u) {
  Unit& x = units_[u];
  return whole_grads() ? x.grad + (x.own.begin - plan_.units[u].range.begin) : x.grad;
}

void ShardedCudaState::take_sum_of_squares(int u, cudaStream_t s, void* ws) {
  if (!partial_[u].empty()) {  // summed over tp on its stream, between events on s
    tp_ready_.record(s);
    tp_.device->wait_event(tp_ready_.get());
    float* g = own_grads(u);
    tp_.device->group_start();
    for (const Range& r : partial_[u])
      tp_.device->all_reduce_async(g + r.begin, r.size(), DType::kF32, ReduceOp::kSum);
    tp_.device->group_end();
    tp_done_.record(tp_.device->stream());
    QT_CHECK_CUDA(cudaStreamWaitEvent(s, tp_done_.get(), 0));
  }
  if (!shared_[u].empty()) sum_shared_kv_rows(u, s);
  const std::vector<Range>& parts = counted_[static_cast<std::size_t>(u)];
  for (std::size_t k = 0; k < parts.size(); ++k)
    grad_norm_squared(unit_sumsq_ + sumsq_at_[u] + k, shard_grads(u) + parts[k].begin,
                      parts[k].size(), ws, s);
  summed_[u] = 1;
}

// A kv head's rows shared by kv_replicas_ consecutive tp ranks (fewer kv heads than tp ranks):
// each holds its query heads' part of their gradient, summed over the group only, in rank order
// (the same bits on each). Every tp rank's part is gathered (tp x the rows, where a group
// communicator would move kv_replicas_ x; small beside a layer's all-reduces), then added up.
void ShardedCudaState::sum_shared_kv_rows(int u, cudaStream_t s) {
  const std::vector<Range>& parts = shared_[u];
  std::size_t n = 0;
  for (const Range& r : parts) n += r.size();
  const std::size_t tp = static_cast<std::size_t>(tp_.device->size());
  float* g = own_grads(u);
  tp_ready_.record(s);
  tp_.device->wait_event(tp_ready_.get());
  tp_.device->group_start();
  for (std::size_t k = 0, at = 0; k < parts.size(); at += parts[k].size(), ++k)
    tp_.device->all_gather_async(g + parts[k].begin, shared_gathered_ + at * tp, parts[k].size(),
                                 DType::kF32);
  tp_.device->group_end();
  tp_done_.record(tp_.device->stream());
  QT_CHECK_CUDA(cudaStreamWaitEvent(s, tp_done_.get(), 0));
  const std::size_t first = static_cast<std::size_t>(tp_.device->rank() / kv_replicas_ *
                                                     kv_replicas_);
  for (std::size_t k = 0, at = 0; k < parts.size(); at += parts[k].size(), ++k) {
    const std::size_t m = parts[k].size();
    const float* all = shared_gathered_ + at * tp;  // [tp, m]
    float* out = g + parts[k].begin;
    QT_CHECK_CUDA(cudaMemcpyAsync(out, all + first * m, m * sizeof(float),
                                  cudaMemcpyDeviceToDevice, s));
    for (std::size_t j = 1; j < static_cast<std::size_t>(kv_replicas_); ++j)
      add_f32(out, all + (first + j) * m, m, s);
  }
}

const float* ShardedCudaState::shard_grads(int u) const {
  const Unit& x = units_[u];
  return whole_grads() ? x.grad + (x.shard.begin - plan_.units[u].range.begin) : x.grad;
}

bf16* ShardedCudaState::updated_weights(int u) {
  const Unit& x = units_[u];
  return gathers() ? x.weights : x.weights + (x.own.begin - plan_.units[u].range.begin);
}

void ShardedCudaState::share_update(int u, cudaStream_t s) {
  NcclComm& c = comm(u);
  compute_done_.record(s);
  c.wait_event(compute_done_.get());
  const std::size_t chunk = plan_.units[u].chunk;
  bf16* whole = units_[u].weights;  // rank r's shard sits at r x chunk
  c.all_gather_async(whole + chunk * group_rank(u), whole, chunk, DType::kBF16);
}

void ShardedCudaState::host_adamw(int u, const AdamWStep& st, const float* grads, bf16* out) {
  Unit& x = units_[u];
  struct Task {
    std::size_t lo, hi;  // within the own shard
    bool decay;
  };
  std::vector<Task> tasks;
  for (std::size_t t : plan_.units[u].params) {
    const ParamInfo& p = layout_.params()[t];
    const std::size_t lo = std::max(x.own.begin, p.offset);
    const std::size_t hi = std::min(x.own.end, p.offset + p.numel);
    for (std::size_t a = lo; a < hi; a += kHostSlice)
      tasks.push_back({a - x.own.begin, std::min(hi, a + kHostSlice) - x.own.begin, p.weight_decay});
  }
  const unsigned threads = std::min<unsigned>(host_threads_, std::max<std::size_t>(1, tasks.size()));
  auto run = [&](unsigned k) {
    for (std::size_t i = k; i < tasks.size(); i += threads) {
      const Task& t = tasks[i];
      adamw_update_host(x.host_master.data() + t.lo, grads + t.lo, x.host_m.data() + t.lo,
                   x.host_v.data() + t.lo, t.hi - t.lo, st, t.decay);
      for (std::size_t j = t.lo; j < t.hi; ++j) out[j] = __float2bfloat16_rn(x.host_master[j]);
    }
  };
  std::vector<std::thread> pool;
  for (unsigned k = 1; k < threads; ++k) pool.emplace_back(run, k);
  run(0);
  for (std::thread& t : pool) t.join();
}

void ShardedCudaState::offload_step(const AdamWStep& hs) {
  // Unit u: its gradients came to host buffer u % 2 while unit u - 1 was updated; unit u + 1's
  // go to the other buffer now; u's bf16 weights go back while u + 1 is updated.
  auto fetch = [&](std::size_t u) {
    const int k = static_cast<int>(u % 2);
    QT_CHECK_CUDA(cudaMemcpyAsync(stage_grads_[k].as<float>(), own_grads(static_cast<int>(u)),
                                  units_[u].own.size() * sizeof(float), cudaMemcpyDeviceToHost,
                                  to_host_.get()));
    grads_landed_[k].record(to_host_.get());
  };
  if (!units_.empty()) fetch(0);
  for (std::size_t u = 0; u < units_.size(); ++u) {
    const int k = static_cast<int>(u % 2);
    grads_landed_[k].synchronize();
    if (u + 1 < units_.size()) fetch(u + 1);
    weights_sent_[k].synchronize();  // unit u - 2's weights have left this buffer
    host_adamw(static_cast<int>(u), hs, stage_grads_[k].as<float>(), stage_weights_[k].as<bf16>());
    QT_CHECK_CUDA(cudaMemcpyAsync(updated_weights(static_cast<int>(u)), stage_weights_[k].as<bf16>(),
                                  units_[u].own.size() * sizeof(bf16), cudaMemcpyHostToDevice,
                                  to_device_.get()));
    weights_sent_[k].record(to_device_.get());
  }
  to_device_.synchronize();
}

OptimStepStats ShardedCudaState::step(const StepRequest& request, std::int64_t total_steps,
                                      cudaStream_t s) {
  if (nccl_) {
    if (zero_ <= 1)  // units whose last micro-batch did not reduce them (LoRA's adapters)
      for (std::size_t u = 0; u < units_.size(); ++u)
        if (!reduced_[u] && units_[u].held) reduce_whole(static_cast<int>(u), s);
    synchronize_comms();  // every reduction, add and sum of squares has landed
  }
  OptimStepStats st;
  st.lr = lr_at(cfg_, static_cast<int>(total_steps), request.step);
  // The norm: each unit's sum of squares over its shard (in unit order, so the same bits
  // however it was taken), summed over dp.
  for (std::size_t u = 0; u < units_.size(); ++u) {
    if (summed_[u] || !units_[u].held) continue;
    const Unit& x = units_[u];
    if (!whole_grads() && !reduced_[u])  // no gradient reached this unit this step
      QT_CHECK_CUDA(cudaMemsetAsync(x.grad, 0, plan_.units[u].chunk * sizeof(float), s));
    take_sum_of_squares(static_cast<int>(u), s, norm_ws_);
  }
  std::vector<double> unit_sumsq(sumsq_at_.back());
  QT_CHECK_CUDA(cudaMemcpyAsync(unit_sumsq.data(), unit_sumsq_, unit_sumsq.size() * sizeof(double),
                                cudaMemcpyDeviceToHost, s));
  QT_CHECK_CUDA(cudaStreamSynchronize(s));
  double sumsq = 0;
  for (const double x : unit_sumsq) sumsq += x;
  sumsq = dp_.sum(sumsq);
  if (tp_.host) sumsq = tp_.host->sum(sumsq);
  if (pp_) sumsq = pp_->sum(sumsq);
  begin_step();  // the next step's gradients start afresh
  // A non-finite loss or norm (summed over the mesh: the same on every rank) skips the update:
  // the master weights, moments and bf16 copies stay as they were (at ZeRO-3 the next forward
  // gathers its first units itself, as after the run's start).
  judge_gradients(st, sumsq, request, cfg_.grad_clip);
  if (st.skipped) return st;
  if (!offload_) {
    AdamWStepArgs args;
    args.lr = st.lr;
    args.beta1 = cfg_.beta1;
    args.beta2 = cfg_.beta2;
    args.eps = cfg_.eps;
    args.weight_decay = cfg_.weight_decay;
    args.clip_scale = st.clip_scale;
    args.step = request.update;
    for (std::size_t u = 0; u < units_.size(); ++u) {
      Unit& x = units_[u];
      if (!x.held) continue;
      adamw_step(x.master, updated_weights(static_cast<int>(u)), x.m, x.v,
                 own_grads(static_cast<int>(u)), x.own.size(), x.own.begin, segments_,
                 num_segments_, args, s);
      // Its bf16 shard to every rank, or (ZeRO-3) the next forward's first units gathered,
      // while the rest update.
      if (shares_updates()) share_update(static_cast<int>(u), s);
      if (u < 2) prefetch_for_next_step(static_cast<int>(u), s);
    }
  } else {
    QT_CHECK_CUDA(cudaStreamSynchronize(s));  // the gradients are final
    offload_step(qt::adamw_step(cfg_, st.lr, st.clip_scale, request.update));
    if (shares_updates())
      for (std::size_t u = 0; u < units_.size(); ++u)
        if (units_[u].held) share_update(static_cast<int>(u), s);
  }
  if (shares_updates()) synchronize_comms();  // every unit's weights are whole again
  QT_CHECK_CUDA(cudaStreamSynchronize(s));
  return st;
}

void ShardedCudaState::prefetch_for_next_step(int u, cudaStream_t s) {
  if (!gathers() || weight_at_[u] != nullptr) return;
  Slot* slot = u == 0 ? &embed_weights_ : free_slot(weight_ring_);
  if (slot == nullptr) return;
  compute_done_.record(s);  // unit u's update
  comm(u).wait_event(compute_done_.get());
  gather(u, *slot);
}

void ShardedCudaState::drop_prefetched() {
  if (!gathers()) return;
  synchronize_comms();
  for (Slot*& slot : weight_at_)
    if (slot != nullptr) {
      give_up(*slot);
      slot = nullptr;
    }
}

std::vector<FlatPiece> ShardedCudaState::param_pieces() {
  std::vector<FlatPiece> out;
  for (Unit& x : units_)
    if (x.own.size() > 0) out.push_back({x.own, x.host_master.data()});
  return out;
}

std::vector<StatePiece> ShardedCudaState::checkpoint_pieces() {
  std::vector<StatePiece> out;
  for (std::size_t u = 0; u < units_.size(); ++u) {
    Unit& x = units_[u];
    // A tied embedding's copy on the last pipeline stage: the first stage writes the original.
    if (x.shard.size() == 0 || static_cast<int>(u) == uncounted_) continue;
    const std::size_t at = x.shard.begin - x.own.begin;  // ZeRO-0: the shard within the whole
    out.push_back({x.shard, x.host_master.data() + at, x.host_m.data() + at,
                   x.host_v.data() + at});
  }
  return out;
}

StateTargets ShardedCudaState::checkpoint_targets() {
  StateTargets t;
  for (Unit& x : units_) {
    if (x.own.size() == 0) continue;
    t.params.push_back({x.own, x.host_master.data()});
    t.exp_avg.push_back({x.own, x.host_m.data()});
    t.exp_avg_sq.push_back({x.own, x.host_v.data()});
  }
  return t;
}

void ShardedCudaState::push(cudaStream_t s) {
  QT_CHECK_CUDA(cudaStreamSynchronize(s));
  drop_prefetched();
  for (std::size_t u = 0; u < units_.size(); ++u) {
    Unit& x = units_[u];
    if (!x.held) continue;
    const std::size_t n = x.own.size();
    bf16* w = updated_weights(static_cast<int>(u));
    if (!offload_) {
      upload(x.master, x.host_master.data(), n * sizeof(float));
      upload(x.m, x.host_m.data(), n * sizeof(float));
      upload(x.v, x.host_v.data(), n * sizeof(float));
      convert_f32_to_bf16(w, x.master, n, s);
    } else {
      bf16* stage = stage_weights_[0].as<bf16>();
      for (std::size_t j = 0; j < n; ++j) stage[j] = __float2bfloat16_rn(x.host_master[j]);
      QT_CHECK_CUDA(cudaMemcpyAsync(w, stage, n * sizeof(bf16), cudaMemcpyHostToDevice, s));
    }
    QT_CHECK_CUDA(cudaStreamSynchronize(s));
  }
  if (shares_updates()) {
    for (std::size_t u = 0; u < units_.size(); ++u)
      if (units_[u].held) share_update(static_cast<int>(u), s);
    synchronize_comms();
  }
}

void ShardedCudaState::synchronize_comms() {
  nccl_->synchronize();
  if (edp_) edp_->synchronize();
}

void ShardedCudaState::pull(cudaStream_t s) {
  QT_CHECK_CUDA(cudaStreamSynchronize(s));
  if (offload_) return;  // the host copies are the live state
  for (Unit& x : units_) {
    if (!x.held) continue;
    const std::size_t b = x.own.size() * sizeof(float);
    QT_CHECK_CUDA(cudaMemcpy(x.host_master.data(), x.master, b, cudaMemcpyDeviceToHost));
    QT_CHECK_CUDA(cudaMemcpy(x.host_m.data(), x.m, b, cudaMemcpyDeviceToHost));
    QT_CHECK_CUDA(cudaMemcpy(x.host_v.data(), x.v, b, cudaMemcpyDeviceToHost));
  }
}

}  // namespace qt::cuda
