// LoRA adapters on the CPU (see lora.h): layout, PEFT's initialisation, the forward and backward
// of one adapted projection, and merging into the base weights.
#include "model/lora.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <tuple>

#include "ops/gemm.h"
#include "parallel/expert_parallel.h"
#include "parallel/tensor_parallel.h"
#include "qtrain/error.h"
#include "runtime/rng.h"

namespace qt {

namespace {

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return {};
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

// "dir/" and "dir/./" name the same directory as "dir".
std::string normal_dir(const std::string& d) {
  std::string s = std::filesystem::path(d).lexically_normal().string();
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  return s;
}

}  // namespace

namespace {
// Both kinds of target of a comma list: {kLoraTargets indices, kLoraExpertTargets indices}.
std::pair<std::vector<int>, std::vector<int>> parse_target_list(const std::string& list,
                                                                const std::string& what) {
  std::string names;
  for (const char* n : kLoraTargets) names += (names.empty() ? "" : " | ") + std::string(n);
  for (const char* n : kLoraExpertTargets) names += " | " + std::string(n);
  std::vector<int> out, experts;
  if (trim(list) == "all-linear") {  // PEFT's shorthand: every projection (never lm_head)
    for (int t = 0; t < kNumLoraTargets; ++t) out.push_back(t);
    return {out, experts};
  }
  for (std::size_t start = 0;;) {
    const std::size_t comma = list.find(',', start);
    const std::string item =
        trim(list.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (item.empty())
      fail_user("{}: an empty name in the list; give a comma list of {} (or all-linear)", what,
                names);
    auto it = std::find_if(kLoraTargets.begin(), kLoraTargets.end(),
                           [&](const char* n) { return item == n; });
    auto ex = std::find_if(kLoraExpertTargets.begin(), kLoraExpertTargets.end(),
                           [&](const char* n) { return item == n; });
    if (it == kLoraTargets.end() && ex == kLoraExpertTargets.end())
      fail_user("{}: unknown target {}; targets are {} (or all-linear)", what, item, names);
    std::vector<int>& into = it != kLoraTargets.end() ? out : experts;
    const int idx = it != kLoraTargets.end() ? static_cast<int>(it - kLoraTargets.begin())
                                             : static_cast<int>(ex - kLoraExpertTargets.begin());
    if (std::find(into.begin(), into.end(), idx) != into.end())
      fail_user("{}: {} is given twice", what, item);
    into.push_back(idx);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  std::sort(out.begin(), out.end());
  std::sort(experts.begin(), experts.end());
  return {out, experts};
}
}  // namespace

std::vector<int> parse_lora_targets(const std::string& list, const std::string& what) {
  return parse_target_list(list, what).first;
}

std::vector<int> parse_lora_expert_targets(const std::string& list, const std::string& what) {
  return parse_target_list(list, what).second;
}

LoraBase LoraBase::of(const std::string& init, std::uint64_t seed) {
  LoraBase b{init, seed, ""};
  if (!init.empty()) b.init_abs = normal_dir(std::filesystem::absolute(init).string());
  return b;
}

std::string LoraBase::describe() const {
  if (init.empty()) return fmt::format("train.seed = {}", seed);
  if (init_abs.empty() || init_abs == normal_dir(init)) return fmt::format("model.init = {}", init);
  return fmt::format("model.init = {} ({})", init, init_abs);
}

bool LoraBase::same_as(const LoraBase& o) const {
  if (init.empty() || o.init.empty()) return init.empty() && o.init.empty() && seed == o.seed;
  auto abs = [](const LoraBase& b) {
    return b.init_abs.empty() ? of(b.init, b.seed).init_abs : b.init_abs;
  };
  return normal_dir(abs(*this)) == normal_dir(abs(o));
}

std::string lora_param_name(int layer, int target, char which) {
  return fmt::format("base_model.model.model.layers.{}.{}.lora_{}.weight", layer,
                     kLoraModules[target], which);
}

std::string lora_expert_param_name(int layer, int et, char which) {
  return fmt::format("base_model.model.model.layers.{}.mlp.{}.lora_{}.weight", layer,
                     kLoraExpertTargets[et], which);
}

std::pair<int, int> lora_expert_dims(const ModelConfig& c, int et) {
  const int H = c.hidden_size, Im = c.moe_intermediate_size;
  QT_CHECK(et == kLoraExpertsGateUp || et == kLoraExpertsDown, "expert target {}", et);
  return et == kLoraExpertsGateUp ? std::pair{H, 2 * Im} : std::pair{Im, H};
}

bool lora_target_in_layer(const ModelConfig& cfg, int layer, int target) {
  const bool mlp = target == kLoraGate || target == kLoraUp || target == kLoraDown;
  return !mlp || !cfg.is_moe_layer(layer);
}

std::pair<int, int> lora_target_dims(const ModelConfig& c, int target) {
  const int H = c.hidden_size, Q = c.q_dim(), KV = c.kv_dim(), I = c.intermediate_size;
  switch (target) {
    case kLoraQ:
      return {H, Q};
    case kLoraK:
      return {H, KV};
    case kLoraV:
      return {H, KV};
    case kLoraO:
      return {Q, H};
    case kLoraGate:
      return {H, I};
    case kLoraUp:
      return {H, I};
    case kLoraDown:
      return {I, H};
  }
  QT_CHECK(false, "LoRA target {} out of range", target);
  return {0, 0};
}

ParamLayout lora_layout(const ModelConfig& cfg, const LoraConfig& lora) {
  return lora_layout(cfg, lora, 0, cfg.num_layers);
}

ParamLayout lora_layout(const ModelConfig& cfg, const LoraConfig& lora, int first_layer,
                        int last_layer) {
  QT_CHECK(lora.r > 0, "lora_layout with r = {}", lora.r);
  QT_CHECK(0 <= first_layer && first_layer < last_layer && last_layer <= cfg.num_layers,
           "LoRA layers [{}, {}) of a model of {}", first_layer, last_layer, cfg.num_layers);
  const std::vector<int> targets = parse_lora_targets(lora.targets, "lora.targets");
  const std::vector<int> experts = parse_lora_expert_targets(lora.targets, "lora.targets");
  QT_CHECK(experts.empty() || cfg.is_moe(), "expert adapters on a dense model");
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> tensors;
  for (int l = first_layer; l < last_layer; ++l) {
    for (int t : targets) {
      if (!lora_target_in_layer(cfg, l, t)) continue;
      const auto [in, out] = lora_target_dims(cfg, t);
      tensors.push_back({lora_param_name(l, t, 'A'), {lora.r, in}});
      tensors.push_back({lora_param_name(l, t, 'B'), {out, lora.r}});
    }
    if (!cfg.is_moe_layer(l)) continue;
    const std::int64_t E = cfg.local_experts();  // an ep rank's own (plan_adapters)
    for (int et : experts) {
      const auto [in, out] = lora_expert_dims(cfg, et);
      tensors.push_back({lora_expert_param_name(l, et, 'A'), {E, lora.r, in}});
      tensors.push_back({lora_expert_param_name(l, et, 'B'), {E, out, lora.r}});
    }
  }
  return ParamLayout(tensors);
}

void lora_init(const ParamLayout& layout, std::uint64_t seed, float* adapters) {
  for (const ParamInfo& p : layout.params()) {
    float* w = adapters + p.offset;
    if (p.name.find(".lora_B.") != std::string::npos) {
      std::fill(w, w + p.numel, 0.0f);
      continue;
    }
    // kaiming_uniform_(a = sqrt(5)): gain sqrt(2 / (1 + 5)), bound gain * sqrt(3 / fan_in).
    const double bound = 1.0 / std::sqrt(static_cast<double>(p.shape.back()));
    const std::uint64_t stream = rng::hash_combine(seed, rng::hash_string(p.name));
    for (std::size_t i = 0; i < p.numel; ++i)
      w[i] = static_cast<float>(bound * (2.0 * rng::uniform(stream, i) - 1.0));
  }
}

std::uint64_t lora_dropout_stream(std::uint64_t seed, int layer, int target) {
  return rng::hash_combine(rng::hash_combine(seed, rng::hash_string("lora_dropout")),
                           static_cast<std::uint64_t>(layer) * kNumLoraTargets + target);
}

void lora_merge(const ModelConfig& cfg, const LoraConfig& lora, const float* adapters,
                const ParamLayout& base_layout, float* base) {
  const ParamLayout layout = lora_layout(cfg, lora);
  const float scale = static_cast<float>(lora.scale());
  for (int l = 0; l < cfg.num_layers; ++l) {
    for (int t : parse_lora_targets(lora.targets, "lora.targets")) {
      if (!lora_target_in_layer(cfg, l, t)) continue;
      const auto [in, out] = lora_target_dims(cfg, t);
      const float* A = adapters + layout.find(lora_param_name(l, t, 'A')).offset;  // [r, in]
      const float* B = adapters + layout.find(lora_param_name(l, t, 'B')).offset;  // [out, r]
      float* W =
          base + base_layout.find(fmt::format("model.layers.{}.{}.weight", l,
                                              kLoraModules[t]))
                     .offset;  // [out, in]
      // W[out, in] += scale * B[out, r] A[r, in]
      cpu::gemm<float>(false, false, out, in, lora.r, scale, B, lora.r, A, in, 1.0f, W, in);
    }
    if (!cfg.is_moe_layer(l)) continue;
    for (int et : parse_lora_expert_targets(lora.targets, "lora.targets")) {
      const auto [in, out] = lora_expert_dims(cfg, et);
      const float* A = adapters + layout.find(lora_expert_param_name(l, et, 'A')).offset;
      const float* B = adapters + layout.find(lora_expert_param_name(l, et, 'B')).offset;
      float* W = base + base_layout.find(fmt::format("model.layers.{}.mlp.{}", l,
                                                     kLoraExpertTargets[et]))
                            .offset;  // [El, out, in]
      const std::size_t r = lora.r;
      QT_CHECK(cfg.expert_shards == 1, "lora_merge into an ep rank's experts");
      for (int e = 0; e < cfg.num_experts; ++e)  // W_e[out, in] += scale * B_e A_e
        cpu::gemm<float>(false, false, out, in, lora.r, scale, B + e * out * r, lora.r,
                         A + e * r * in, in, 1.0f, W + std::size_t(e) * out * in, in);
    }
  }
}

ParamLayout lora_layout(const ModelConfig& cfg, const LoraConfig& lora,
                        const std::vector<std::pair<int, int>>& layer_ranges) {
  std::vector<std::pair<std::string, std::vector<std::int64_t>>> tensors;
  for (const auto& [first, last] : layer_ranges) {
    const ParamLayout part = lora_layout(cfg, lora, first, last);
    for (const ParamInfo& p : part.params()) tensors.push_back({p.name, p.shape});
  }
  return ParamLayout(tensors);
}

std::unique_ptr<LayoutMap> lora_map(const ModelConfig& cfg, const LoraConfig& lora,
                                    const std::vector<std::pair<int, int>>& layer_ranges,
                                    const ParamLayout& global, const ParamLayout& local,
                                    const ShardPlan& local_plan, const MeshShape& mesh,
                                    int tp_rank, int ep_rank) {
  const bool sharded = cfg.is_moe() && mesh.ep > 1 &&
                       !parse_lora_expert_targets(lora.targets, "lora.targets").empty();
  if (!sharded) {  // null when the local layout is the global one
    const bool whole = layer_ranges.size() == 1 && layer_ranges[0].first == 0 &&
                       layer_ranges[0].second == cfg.num_layers;
    if (mesh.tp == 1 && whole) return nullptr;
    return std::make_unique<TpMap>(global, local, local_plan, tp_rank);
  }
  // Through the same layers' adapters of the tp rank's model at ep 1 (whole over ep).
  ParamLayout tp_layout = lora_layout(tp_local_config(cfg, mesh.tp), lora, layer_ranges);
  MeshShape tp_only;
  tp_only.tp = mesh.tp;
  tp_only.sequence_parallel = mesh.sequence_parallel;
  ShardPlan tp_plan = plan_adapters(tp_layout, tp_only, 0, tp_kv_replicas(cfg, mesh.tp));
  return std::make_unique<TpEpMap>(global, local, std::move(tp_layout), std::move(tp_plan),
                                   tp_rank, ep_rank);
}

LoraAdapters::LoraAdapters(const ModelConfig& cfg, const LoraConfig& lora, int B, int T,
                           int first_layer, int last_layer, int slots)
    : cfg_(cfg),
      lora_(lora),
      layout_(lora_layout(cfg, lora, first_layer, last_layer)),
      B_(B),
      T_(T),
      N_(B * T),
      first_layer_(first_layer),
      last_layer_(last_layer),
      slots_in_flight_(slots),
      scale_(lora.scale()) {
  QT_CHECK(slots >= 1, "LoRA adapters for {} micro-batches in flight", slots);
  slots_.resize(static_cast<std::size_t>(cfg.num_layers) * kNumLoraTargets);
  int max_in = 0;
  for (int l = first_layer; l < last_layer; ++l) {
    for (int t : parse_lora_targets(lora.targets, "lora.targets")) {
      if (!lora_target_in_layer(cfg, l, t)) continue;
      Slot& s = slots_[static_cast<std::size_t>(l) * kNumLoraTargets + t];
      s.on = true;
      std::tie(s.in, s.out) = lora_target_dims(cfg, t);
      s.in_global = s.in;
      s.a = layout_.find(lora_param_name(l, t, 'A')).offset;
      s.b = layout_.find(lora_param_name(l, t, 'B')).offset;
      s.xa.resize(static_cast<std::size_t>(slots) * N_ * lora.r);
      max_in = std::max(max_in, s.in);
    }
  }
  const std::vector<int> experts = parse_lora_expert_targets(lora.targets, "lora.targets");
  expert_at_.assign(static_cast<std::size_t>(cfg.num_layers) * kNumLoraExpertTargets,
                    {std::string::npos, std::string::npos});
  for (int l = first_layer; l < last_layer; ++l) {
    if (!cfg.is_moe_layer(l)) continue;
    for (int et : experts) {
      expert_at_[static_cast<std::size_t>(l) * kNumLoraExpertTargets + et] = {
          layout_.find(lora_expert_param_name(l, et, 'A')).offset,
          layout_.find(lora_expert_param_name(l, et, 'B')).offset};
      experts_on_ = true;
    }
  }
  const std::size_t N = N_;
  if (lora.dropout > 0) {
    xd_.resize(N * max_in);
    mask_.resize(N * max_in);
  }
  g_.resize(N * lora.r);
  dxd_.resize(N * max_in);
}

cpu::ExpertLora<float> LoraAdapters::experts(int layer, bool grads) const {
  cpu::ExpertLora<float> e;
  if (!experts_on_) return e;
  QT_CHECK(buf_.bound() && (!grads || buf_.has_grads()),
           "expert adapters without their weights or gradients (bind() first)");
  QT_CHECK(lora_.dropout == 0 || !dropout_on_, "lora.dropout on the experts' adapters");
  e.r = lora_.r;
  e.scale = static_cast<float>(scale_);
  const std::size_t at = static_cast<std::size_t>(layer) * kNumLoraExpertTargets;
  const auto [gua, gub] = expert_at_.at(at + kLoraExpertsGateUp);
  const auto [dna, dnb] = expert_at_.at(at + kLoraExpertsDown);
  if (gua != std::string::npos) {
    e.gu_a = buf_.weights(gua), e.gu_b = buf_.weights(gub);
    if (grads) e.g_gu_a = buf_.grads(gua), e.g_gu_b = buf_.grads(gub);
  }
  if (dna != std::string::npos) {
    e.dn_a = buf_.weights(dna), e.dn_b = buf_.weights(dnb);
    if (grads) e.g_dn_a = buf_.grads(dna), e.g_dn_b = buf_.grads(dnb);
  }
  return e;
}

void LoraAdapters::select_slot(int slot) {
  QT_CHECK(slot >= 0 && slot < slots_in_flight_, "LoRA slot {} of {}", slot, slots_in_flight_);
  xa_at_ = static_cast<std::size_t>(slot) * N_ * lora_.r;
}

void LoraAdapters::set_tensor_parallel(int tp, int rank) {
  for (std::size_t k = 0; k < slots_.size(); ++k) {
    Slot& s = slots_[k];
    const int t = static_cast<int>(k % kNumLoraTargets);
    const bool row_parallel = t == kLoraO || t == kLoraDown;
    s.in_global = row_parallel ? s.in * tp : s.in;
    s.col0 = row_parallel ? s.in * rank : 0;
  }
}

void LoraAdapters::set_context_parallel(int seq_len, const std::vector<std::int32_t>& index) {
  QT_CHECK(static_cast<int>(index.size()) == T_ && seq_len >= T_,
           "LoRA adapters of {} tokens a sequence for {} of {}", T_, index.size(), seq_len);
  seq_len_ = seq_len;
  token_index_ = index;
}

const float* LoraAdapters::dropped(int layer, int target, const Slot& s, const float* x) {
  const int in = s.in;
  const double p = dropout_on_ ? lora_.dropout : 0.0;
  if (p <= 0) return x;
  const float keep_scale = static_cast<float>(1.0 / (1.0 - p));
  const std::uint64_t stream = lora_dropout_stream(seed_, layer, target);
  for (int n = 0; n < N_; ++n) {
    // Token t of the sequence with index g in the data order.
    const std::uint64_t g = static_cast<std::uint64_t>(first_sample_ + n / T_);
    const std::uint64_t t = static_cast<std::uint64_t>(
        token_index_.empty() ? n % T_ : token_index_[static_cast<std::size_t>(n % T_)]);
    const std::uint64_t first = (g * static_cast<std::uint64_t>(seq_len_) + t) *
                                    static_cast<std::uint64_t>(s.in_global) +
                                static_cast<std::uint64_t>(s.col0);
    const std::size_t row = static_cast<std::size_t>(n) * in;
    for (int i = 0; i < in; ++i) {
      const float m = rng::uniform(stream, first + i) >= p ? keep_scale : 0.0f;
      mask_[row + i] = m;
      xd_[row + i] = x[row + i] * m;
    }
  }
  return xd_.data();
}

void LoraAdapters::forward(int layer, int target, const float* x, float* y, int ldy) {
  Slot& s = slots_[static_cast<std::size_t>(layer) * kNumLoraTargets + target];
  if (!s.on) return;
  QT_CHECK(buf_.bound(), "LoRA forward without adapter weights (bind() first)");
  const int r = lora_.r;
  const float* xd = dropped(layer, target, s, x);
  // xa[N, r] = xd[N, in] A[r, in]^T
  float* xa = s.xa.data() + xa_at_;
  cpu::gemm<float>(false, true, N_, r, s.in, 1.0f, xd, s.in, buf_.weights(s.a), s.in, 0.0f, xa,
                   r);
  // y[N, out] += scale * xa[N, r] B[out, r]^T
  cpu::gemm<float>(false, true, N_, s.out, r, static_cast<float>(scale_), xa, r,
                   buf_.weights(s.b), r, 1.0f, y, ldy > 0 ? ldy : s.out);
}

void LoraAdapters::backward(int layer, int target, const float* x, const float* dy, float* dx,
                            int lddy) {
  Slot& s = slots_[static_cast<std::size_t>(layer) * kNumLoraTargets + target];
  if (!s.on) return;
  QT_CHECK(buf_.has_grads(),
           "LoRA backward without adapter weights and gradients (bind() first)");
  const int r = lora_.r, N = N_;
  const float scale = static_cast<float>(scale_);
  const float* xd = dropped(layer, target, s, x);  // the forward's mask again
  const float* A = buf_.weights(s.a);  // [r, in]
  const float* B = buf_.weights(s.b);  // [out, r]
  const int ld = lddy > 0 ? lddy : s.out;
  // dB[out, r] += scale * dy[N, out]^T xa[N, r]
  cpu::gemm<float>(true, false, s.out, r, N, scale, dy, ld, s.xa.data() + xa_at_, r, 1.0f,
                   buf_.grads(s.b), r);
  // g[N, r] = dy[N, out] B[out, r]
  cpu::gemm<float>(false, false, N, r, s.out, 1.0f, dy, ld, B, r, 0.0f, g_.data(), r);
  // dA[r, in] += scale * g[N, r]^T xd[N, in]
  cpu::gemm<float>(true, false, r, s.in, N, scale, g_.data(), r, xd, s.in, 1.0f, buf_.grads(s.a),
                   s.in);
  if (dx == nullptr) return;
  // d xd[N, in] = scale * g[N, r] A[r, in]; through the dropout mask into dx.
  cpu::gemm<float>(false, false, N, s.in, r, scale, g_.data(), r, A, s.in, 0.0f, dxd_.data(), s.in);
  const std::size_t n = static_cast<std::size_t>(N) * s.in;
  if (lora_.dropout > 0 && dropout_on_) {
    for (std::size_t i = 0; i < n; ++i) dx[i] += dxd_[i] * mask_[i];
  } else {
    for (std::size_t i = 0; i < n; ++i) dx[i] += dxd_[i];
  }
}

}  // namespace qt
