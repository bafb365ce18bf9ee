// Expert parallelism on the CPU reference (parallel/expert_parallel.h).
#include "parallel/expert_parallel.h"

#include <algorithm>
#include <numeric>
#include <string>
#include <unordered_map>
#include <utility>

#include "ops/linear.h"
#include "ops/moe_experts.h"
#include "qtrain/error.h"

namespace qt {

std::vector<std::size_t> block_offsets(const std::vector<std::size_t>& counts) {
  std::vector<std::size_t> at(counts.size(), 0);
  for (std::size_t p = 1; p < counts.size(); ++p) at[p] = at[p - 1] + counts[p - 1];
  return at;
}

std::vector<std::size_t> scaled_counts(const std::vector<std::size_t>& v, std::size_t f) {
  std::vector<std::size_t> out(v);
  for (std::size_t& x : out) x *= f;
  return out;
}

ModelConfig ep_local_config(const ModelConfig& cfg, int ep) {
  QT_CHECK(ep >= 1 && cfg.expert_shards == 1, "ep_local_config: ep {} of a config stored over {}",
           ep, cfg.expert_shards);
  if (!cfg.is_moe() || ep == 1) return cfg;
  QT_CHECK(cfg.num_experts % ep == 0, "mesh.ep = {} must divide the {} experts", ep,
           cfg.num_experts);
  ModelConfig c = cfg;
  c.expert_shards = ep;
  return c;
}

EpMap::EpMap(const ParamLayout& global, const ParamLayout& local, int ep_rank) {
  const auto& gs = global.params();
  std::unordered_map<std::string, std::size_t> at;  // global tensor index by name
  for (std::size_t i = 0; i < gs.size(); ++i) at.emplace(gs[i].name, i);
  QT_CHECK(gs.size() == local.params().size(), "EpMap: {} global tensors, {} local", gs.size(),
           local.params().size());
  for (const ParamInfo& p : local.params()) {
    const auto it = at.find(p.name);
    QT_CHECK(it != at.end(), "EpMap: local tensor {} is not the global model's", p.name);
    const ParamInfo& g = gs[it->second];
    // Experts: [El, ...] rows of [E, ...], El dividing E; every other tensor whole.
    const bool rows = p.shape != g.shape;
    QT_CHECK(p.shape.size() == g.shape.size() &&
                 (!rows || (p.shape[0] > 0 && g.shape[0] % p.shape[0] == 0 &&
                            std::equal(p.shape.begin() + 1, p.shape.end(), g.shape.begin() + 1))),
             "EpMap: local tensor {} does not divide the global one by rows", p.name);
    QT_CHECK(!rows || ep_rank < g.shape[0] / p.shape[0], "EpMap: ep rank {} of {} for {}",
             ep_rank, g.shape[0] / p.shape[0], p.name);
    places_.push_back({p.offset, p.numel, g.offset + (rows ? ep_rank * p.numel : 0)});
  }
}

std::vector<LayoutMap::Segment> EpMap::segments(Range r, bool) const {
  std::vector<Segment> out;
  for (const Place& p : places_) {
    const std::size_t lo = std::max(r.begin, p.local), hi = std::min(r.end, p.local + p.numel);
    if (lo < hi) out.push_back({lo, p.global + (lo - p.local), hi - lo});
  }
  return out;
}

namespace {
// The plan of the tp rank's model at ep 1 (a dp-1, one-stage mesh: TpMap reads only the specs).
ShardPlan tp_plan(const ModelConfig& cfg, const ParamLayout& tp_layout, const MeshShape& mesh) {
  MeshShape m;
  m.tp = mesh.tp;
  m.sequence_parallel = mesh.sequence_parallel;
  return plan_qwen3(tp_local_config(cfg, mesh.tp), tp_layout, m, 0, tp_kv_replicas(cfg, mesh.tp));
}
}  // namespace

TpEpMap::TpEpMap(const ModelConfig& cfg, const ParamLayout& global, const ParamLayout& local,
                 const MeshShape& mesh, int tp_rank, int ep_rank)
    : TpEpMap(global, local, ParamLayout(tp_local_config(cfg, mesh.tp)),
              tp_plan(cfg, ParamLayout(tp_local_config(cfg, mesh.tp)), mesh), tp_rank, ep_rank) {}

TpEpMap::TpEpMap(const ParamLayout& global, const ParamLayout& local, ParamLayout tp_layout,
                 ShardPlan tp_plan, int tp_rank, int ep_rank)
    : tp_layout_(std::move(tp_layout)),
      tp_plan_(std::move(tp_plan)),
      ep_(tp_layout_, local, ep_rank),
      tp_(global, tp_layout_, tp_plan_, tp_rank) {}

std::vector<LayoutMap::Segment> TpEpMap::segments(Range r, bool writing) const {
  std::vector<Segment> out;
  for (const Segment& a : ep_.segments(r, writing))
    for (const Segment& b : tp_.segments(Range{a.global, a.global + a.count}, writing))
      out.push_back({a.local + (b.local - a.global), b.global, b.count});
  return out;
}

std::unique_ptr<LayoutMap> make_model_map(const ModelConfig& cfg, const ParamLayout& global,
                                          const ParamLayout& local, const ShardPlan& local_plan,
                                          const MeshShape& mesh, int tp_rank, int ep_rank) {
  const bool ep = cfg.is_moe() && mesh.ep > 1;
  if (mesh.tp > 1 && ep)
    return std::make_unique<TpEpMap>(cfg, global, local, mesh, tp_rank, ep_rank);
  if (mesh.tp > 1) return std::make_unique<TpMap>(global, local, local_plan, tp_rank);
  if (ep) return std::make_unique<EpMap>(global, local, ep_rank);
  return nullptr;
}

ExpertDispatch::ExpertDispatch(Comm& ep, int experts, int hidden, int moe_width)
    : ep_(ep), e_(experts), h_(hidden), im_(moe_width) {
  QT_CHECK(experts > 0 && experts % ep.size() == 0, "{} experts over {} expert-parallel ranks",
           experts, ep.size());
  el_ = experts / ep.size();
}

void ExpertDispatch::exchange(const float* send, float* recv, bool forward_direction) {
  const std::size_t H = h_;
  if (forward_direction)
    ep_.all_to_all_v(send, scaled_counts(send_rows_, H), scaled_counts(send_at_, H), recv,
                     scaled_counts(recv_rows_, H), scaled_counts(recv_at_, H), DType::kF32);
  else
    ep_.all_to_all_v(send, scaled_counts(recv_rows_, H), scaled_counts(recv_at_, H), recv,
                     scaled_counts(send_rows_, H), scaled_counts(send_at_, H), DType::kF32);
}

void ExpertDispatch::forward(float* out, const float* x, const int* idx, int N, int k,
                             const float* gate_up, const float* down, const std::uint8_t* keep,
                             const cpu::ExpertLora<float>* lora) {
  const int P = ep_.size();
  const std::size_t H = h_;
  nk_ = N * k;
  // Each kept slot row's owner; rows go out grouped by owner, in slot order within a group.
  send_rows_.assign(P, 0);
  for (int i = 0; i < nk_; ++i) {
    QT_CHECK(idx[i] >= 0 && idx[i] < e_, "expert {} of {}", idx[i], e_);
    if (!keep || keep[i]) ++send_rows_[idx[i] / el_];
  }
  send_at_ = block_offsets(send_rows_);
  std::vector<std::size_t> next = send_at_;
  pos_.assign(nk_, kDropped);
  const std::size_t sent = send_at_.back() + send_rows_.back();
  std::vector<float> send_x(sent * H);
  std::vector<int> send_ids(sent);
  for (int i = 0; i < nk_; ++i) {
    if (keep && !keep[i]) continue;
    const int owner = idx[i] / el_;
    const std::size_t at = next[owner]++;
    pos_[i] = at;
    std::copy(x + (i / k) * H, x + (i / k + 1) * H, send_x.begin() + at * H);
    send_ids[at] = idx[i] - owner * el_;
  }
  // The counts, then the rows and their local expert ids.
  std::vector<std::int64_t> mine(send_rows_.begin(), send_rows_.end()), theirs(P);
  std::vector<std::size_t> ones(P, 1), iota(P);
  std::iota(iota.begin(), iota.end(), 0);
  ep_.all_to_all_v(mine.data(), ones, iota, theirs.data(), ones, iota, DType::kI64);
  recv_rows_.assign(theirs.begin(), theirs.end());
  recv_at_ = block_offsets(recv_rows_);
  const std::size_t R = recv_at_.back() + recv_rows_.back();
  recv_x_.resize(R * H);
  recv_ids_.resize(R);
  exchange(send_x.data(), recv_x_.data(), true);
  ep_.all_to_all_v(send_ids.data(), send_rows_, send_at_, recv_ids_.data(), recv_rows_, recv_at_,
                   DType::kI32);
  // This rank's experts over the rows it received (weight 1: the sender weighs them).
  std::vector<float> ones_w(R, 1.0f), y(R * H);
  cpu::moe_experts_forward(y.data(), recv_x_.data(), recv_ids_.data(), ones_w.data(), gate_up,
                           down, static_cast<int>(R), h_, im_, el_, 1, nullptr, lora);
  std::vector<float> back(sent * H);
  exchange(y.data(), back.data(), false);
  to_slots(back.data(), out);
}

void ExpertDispatch::to_slots(const float* rows, float* slots) const {
  const std::size_t H = h_;
  for (int i = 0; i < nk_; ++i)
    if (pos_[i] == kDropped)
      std::fill(slots + i * H, slots + (i + 1) * H, 0.0f);
    else
      std::copy(rows + pos_[i] * H, rows + (pos_[i] + 1) * H, slots + i * H);
}

void ExpertDispatch::backward(float* dx_slot, const float* dout, const float* gate_up,
                              const float* down, float* g_gate_up, float* g_down,
                              const cpu::ExpertLora<float>* lora) {
  const std::size_t H = h_, R = recv_ids_.size();
  std::vector<float> send((send_at_.back() + send_rows_.back()) * H), dy(R * H);
  for (int i = 0; i < nk_; ++i)
    if (pos_[i] != kDropped)
      std::copy(dout + i * H, dout + (i + 1) * H, send.begin() + pos_[i] * H);
  exchange(send.data(), dy.data(), true);
  std::vector<float> ones_w(R, 1.0f), dw(R), dx(R * H);
  cpu::moe_experts_backward(dx.data(), dw.data(), g_gate_up, g_down, dy.data(), recv_x_.data(),
                            recv_ids_.data(), ones_w.data(), gate_up, down, static_cast<int>(R),
                            h_, im_, el_, 1, nullptr, lora);
  exchange(dx.data(), send.data(), false);
  to_slots(send.data(), dx_slot);
}

namespace {
// A token's slots in ascending expert order (the order the serial experts add them).
std::vector<int> slots_by_expert(const int* idx, int t, int k) {
  std::vector<int> j(k);
  std::iota(j.begin(), j.end(), 0);
  std::sort(j.begin(), j.end(), [&](int a, int b) { return idx[t * k + a] < idx[t * k + b]; });
  return j;
}
}  // namespace

long moe_block_forward_ep(float* y, float* probs, int* idx, float* w, float* slot_out,
                          const float* x, const float* gate, const float* gate_up,
                          const float* down, const cpu::MoeShape& s, ExpertDispatch& dispatch,
                          const float* bias, const cpu::ExpertLora<float>* lora) {
  const std::size_t H = s.H;
  std::vector<float> logits(static_cast<std::size_t>(s.N) * s.E);  // [N, E]
  cpu::linear_forward(logits.data(), x, gate, s.N, s.H, s.E);
  cpu::router_forward(probs, idx, w, logits.data(), s.N, s.E, s.k, s.norm_topk, bias);
  // The drops, decided here over this rank's own tokens: a dropped row is never sent, and its
  // zero output row adds nothing to y and gives d w = dy . 0 = 0 in the backward.
  long dropped = 0;
  const std::vector<std::uint8_t> keep = cpu::moe_capacity_keep(idx, s, &dropped);
  dispatch.forward(slot_out, x, idx, s.N, s.k, gate_up, down,
                   keep.empty() ? nullptr : keep.data(), lora);
  for (int t = 0; t < s.N; ++t) {  // y[t] = sum_j w[t, j] out[t, j]
    float* yt = y + t * H;
    std::fill(yt, yt + H, 0.0f);
    for (int j : slots_by_expert(idx, t, s.k)) {
      const float wj = w[t * s.k + j];
      const float* o = slot_out + (static_cast<std::size_t>(t) * s.k + j) * H;
      for (std::size_t c = 0; c < H; ++c) yt[c] += wj * o[c];
    }
  }
  return dropped;
}

void moe_block_backward_ep(float* dx, float* dgate, float* dgate_up, float* ddown, const float* dy,
                           const float* x, const float* probs, const int* idx, const float* w,
                           const float* slot_out, const float* gate, const float* gate_up,
                           const float* down, const cpu::MoeShape& s, ExpertDispatch& dispatch,
                           const cpu::RouterBalance* balance, float aux_coef,
                           const cpu::ExpertLora<float>* lora) {
  const std::size_t H = s.H, NK = static_cast<std::size_t>(s.N) * s.k;
  // d w[t, j] = dy[t] . out[t, j]; d out[t, j] = w[t, j] dy[t]
  std::vector<float> dw(NK), dout(NK * H), dx_slot(NK * H);
  for (std::size_t i = 0; i < NK; ++i) {
    const float* dyt = dy + (i / s.k) * H;
    double dot = 0;
    for (std::size_t c = 0; c < H; ++c) {
      dot += static_cast<double>(dyt[c]) * slot_out[i * H + c];
      dout[i * H + c] = w[i] * dyt[c];
    }
    dw[i] = static_cast<float>(dot);
  }
  dispatch.backward(dx_slot.data(), dout.data(), gate_up, down, dgate_up, ddown, lora);
  for (int t = 0; t < s.N; ++t) {
    float* dxt = dx + t * H;
    std::fill(dxt, dxt + H, 0.0f);
    for (int j : slots_by_expert(idx, t, s.k)) {
      const float* d = dx_slot.data() + (static_cast<std::size_t>(t) * s.k + j) * H;
      for (std::size_t c = 0; c < H; ++c) dxt[c] += d[c];
    }
  }
  std::vector<float> dlogits(static_cast<std::size_t>(s.N) * s.E), dx_gate(s.N * H);
  cpu::router_backward(dlogits.data(), dw.data(), probs, idx, s.N, s.E, s.k, s.norm_topk);
  if (balance) cpu::router_aux_backward(dlogits.data(), *balance, probs, s.N, aux_coef);
  cpu::linear_backward(dx_gate.data(), dgate, dlogits.data(), x, gate, s.N, s.H, s.E);
  for (std::size_t i = 0; i < dx_gate.size(); ++i) dx[i] += dx_gate[i];
}

}  // namespace qt
