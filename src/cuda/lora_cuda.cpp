// LoRA adapters on the GPU; see lora_cuda.h. Every product is one cuBLASLt GEMM (bf16 in, fp32
// accumulation) on the target's column block of the fused output (leading dimension = the
// site's width), or on the experts one grouped GEMM over all of them (cuda/grouped_gemm.h); the
// weight gradients accumulate in fp32 straight into the gradient buffer.
#include "cuda/lora_cuda.h"

#include <algorithm>
#include <tuple>

#include "cuda/grouped_gemm.h"
#include "model/lora.h"
#include "ops/cuda/gemm.cuh"
#include "ops/moe_capacity.h"
#include "ops/cuda/lora_dropout.cuh"
#include "qtrain/error.h"

namespace qt::cuda {

namespace {

LoraSite site_of(int target) {
  switch (target) {
    case kLoraQ:
    case kLoraK:
    case kLoraV:
      return LoraSite::kQKV;
    case kLoraO:
      return LoraSite::kO;
    case kLoraGate:
    case kLoraUp:
      return LoraSite::kGateUp;
    default:
      return LoraSite::kDown;
  }
}

}  // namespace

LoraCuda::LoraCuda(const ModelConfig& cfg, const LoraConfig& lora, int B, int T,
                   DeviceArena& arena, const std::vector<std::pair<int, int>>& layer_ranges,
                   int slots)
    : cfg_(cfg), lora_(lora), layout_(lora_layout(cfg, lora, layer_ranges)), T_(T), N_(B * T),
      first_layer_(layer_ranges.empty() ? 0 : layer_ranges.front().first),
      slots_in_flight_(slots), scale_(static_cast<float>(lora.scale())) {
  QT_CHECK(!layer_ranges.empty() && slots >= 1, "LoRA adapters of {} layer ranges, {} slots",
           layer_ranges.size(), slots);
  const int Q = cfg.q_dim(), KV = cfg.kv_dim(), I = cfg.intermediate_size;
  // Column of each target in its site's fused output (Qwen3Cuda's qkv_raw and gu rows).
  const std::array<int, kNumLoraTargets> col = {0, Q, Q + KV, 0, 0, I, 0};
  slots_.resize(static_cast<std::size_t>(cfg.num_layers) * 4);
  const std::size_t N = N_;
  int max_in = 0;
  for (const auto& [first, last] : layer_ranges) {
    for (int l = first; l < last; ++l) {
      for (int t : parse_lora_targets(lora.targets, "lora.targets")) {
        Slot s;
        s.target = t;
        std::tie(s.in, s.out) = lora_target_dims(cfg, t);
        s.col = col[t];
        s.in_global = s.in;
        s.a = layout_.find(lora_param_name(l, t, 'A')).offset;
        s.b = layout_.find(lora_param_name(l, t, 'B')).offset;
        s.xa = arena.allocate<bf16>(static_cast<std::size_t>(slots) * N * lora.r);
        max_in = std::max(max_in, s.in);
        slots_[static_cast<std::size_t>(l) * 4 + static_cast<int>(site_of(t))].push_back(s);
      }
    }
  }
  // Adapters on every expert: the stacked tensors of each sparse layer, xa over the rows the
  // experts' buffers hold (cuda_ops_moe.cpp sizes them by the same rule).
  experts_.resize(static_cast<std::size_t>(cfg.num_layers) * kNumLoraExpertTargets);
  const std::vector<int> expert_targets = parse_lora_expert_targets(lora.targets, "lora.targets");
  if (!expert_targets.empty())
    expert_rows_ = static_cast<std::size_t>(
        moe_expert_rows(N_, cfg.num_experts_per_tok, cfg.num_experts, cfg.expert_shards,
                        cfg.moe_capacity_factor));
  for (const auto& [first, last] : layer_ranges)
    for (int l = first; l < last; ++l) {
      if (!cfg.is_moe_layer(l)) continue;
      for (int et : expert_targets) {
        ExpertSlot& e = experts_[static_cast<std::size_t>(l) * kNumLoraExpertTargets + et];
        std::tie(e.in, e.out) = lora_expert_dims(cfg, et);
        e.a = layout_.find(lora_expert_param_name(l, et, 'A')).offset;
        e.b = layout_.find(lora_expert_param_name(l, et, 'B')).offset;
        e.xa = arena.allocate<bf16>(static_cast<std::size_t>(slots) * expert_rows_ * lora.r);
        experts_on_[static_cast<std::size_t>(et)] = true;
      }
    }
  gy_ = arena.allocate<bf16>(std::max(N, expert_rows_) * lora.r);
  if (lora.dropout > 0) xd_ = arena.allocate<bf16>(N * max_in);
}

void LoraCuda::select_slot(int slot) {
  QT_CHECK(slot >= 0 && slot < slots_in_flight_, "LoRA slot {} of {}", slot, slots_in_flight_);
  xa_at_ = static_cast<std::size_t>(slot) * N_ * lora_.r;
  expert_xa_at_ = static_cast<std::size_t>(slot) * expert_rows_ * lora_.r;
}

void LoraCuda::set_tensor_parallel(int tp, int rank) {
  QT_CHECK(tp >= 1 && rank >= 0 && rank < tp, "tp rank {} of {}", rank, tp);
  for (std::vector<Slot>& site : slots_)
    for (Slot& s : site) {
      const bool row_parallel = s.target == kLoraO || s.target == kLoraDown;
      s.in_global = row_parallel ? s.in * tp : s.in;
      s.col0 = row_parallel ? s.in * rank : 0;
    }
}

bool LoraCuda::adapts(LoraSite site) const { return !slots(first_layer_, site).empty(); }

int LoraCuda::width(LoraSite site) const {
  switch (site) {
    case LoraSite::kQKV:
      return cfg_.q_dim() + 2 * cfg_.kv_dim();
    case LoraSite::kGateUp:
      return 2 * cfg_.intermediate_size;
    default:
      return cfg_.hidden_size;
  }
}

LoraDropoutKey LoraCuda::dropout_key(int layer, const Slot& slot) const {
  LoraDropoutKey key;
  key.stream = lora_dropout_stream(seed_, layer, slot.target);
  key.first_row = first_sample_ * T_;
  key.p = lora_.dropout;
  key.keep_scale = static_cast<float>(1.0 / (1.0 - lora_.dropout));
  key.row_width = slot.in_global;
  key.col0 = slot.col0;
  return key;
}

const bf16* LoraCuda::dropped(int layer, const Slot& slot, const bf16* x, cudaStream_t s) {
  if (lora_.dropout <= 0) return x;
  lora_dropout_forward(xd_, x, N_, slot.in, dropout_key(layer, slot), s);
  return xd_;
}

void LoraCuda::forward(int layer, LoraSite site, const bf16* x, bf16* y, cudaStream_t s) {
  QT_CHECK(buf_.bound(), "LoRA forward without adapter weights (bind() first)");
  const int r = lora_.r, ld = width(site);
  for (const Slot& slot : slots(layer, site)) {
    const bf16* xd = dropped(layer, slot, x, s);
    // xa[N, r] = xd[N, in] A[r, in]^T
    bf16* xa = slot.xa + xa_at_;
    gemm(false, true, N_, r, slot.in, 1.f, xd, slot.in, buf_.weights(slot.a), slot.in, 0.f, xa, r,
         s);
    // y[N, col:col+out] += scale * xa[N, r] B[out, r]^T
    gemm(false, true, N_, slot.out, r, scale_, xa, r, buf_.weights(slot.b), r, 1.f, y + slot.col,
         ld, s);
  }
}

void LoraCuda::backward(int layer, LoraSite site, const bf16* x, const bf16* dy, bf16* dx,
                        cudaStream_t s) {
  QT_CHECK(buf_.has_grads(), "LoRA backward without adapter weights and gradients (bind() first)");
  const int r = lora_.r, ld = width(site), N = N_;
  for (const Slot& slot : slots(layer, site)) {
    const bf16* dyt = dy + slot.col;  // [N, out], rows ld apart
    // dB[out, r] += scale * dy[N, out]^T xa[N, r]
    gemm(true, false, slot.out, r, N, scale_, dyt, ld, slot.xa + xa_at_, r, 1.f,
         buf_.grads(slot.b), r, s);
    // g[N, r] = dy[N, out] B[out, r]
    gemm(false, false, N, r, slot.out, 1.f, dyt, ld, buf_.weights(slot.b), r, 0.f, gy_, r, s);
    // dA[r, in] += scale * g[N, r]^T xd[N, in]   (the forward's mask, regenerated)
    const bf16* xd = dropped(layer, slot, x, s);
    gemm(true, false, r, slot.in, N, scale_, gy_, r, xd, slot.in, 1.f, buf_.grads(slot.a), slot.in,
         s);
    if (dx == nullptr) continue;
    const bf16* A = buf_.weights(slot.a);
    if (lora_.dropout <= 0) {
      // dx[N, in] += scale * g[N, r] A[r, in]
      gemm(false, false, N, slot.in, r, scale_, gy_, r, A, slot.in, 1.f, dx, slot.in, s);
    } else {
      // d xd = scale * g A (into xd_, no longer needed), then through the mask into dx.
      gemm(false, false, N, slot.in, r, scale_, gy_, r, A, slot.in, 0.f, xd_, slot.in, s);
      lora_dropout_backward(dx, xd_, N, slot.in, dropout_key(layer, slot), s);
    }
  }
}

const LoraCuda::ExpertSlot& LoraCuda::expert_slot(int layer, int et, int groups,
                                                  int rows) const {
  const ExpertSlot& e = experts_.at(static_cast<std::size_t>(layer) * kNumLoraExpertTargets + et);
  QT_CHECK(e.xa == nullptr || (groups == cfg_.local_experts() && rows >= 0 &&
                               static_cast<std::size_t>(rows) <= expert_rows_),
           "expert adapters of layer {}: {} experts of {} here, {} rows of at most {}", layer,
           groups, cfg_.local_experts(), rows, expert_rows_);
  return e;
}

void LoraCuda::expert_forward(int layer, int et, const bf16* x, bf16* y, const int* offsets,
                              int groups, int rows, cudaStream_t s) {
  const ExpertSlot& e = expert_slot(layer, et, groups, rows);
  if (e.xa == nullptr) return;
  QT_CHECK(buf_.bound(), "LoRA forward without adapter weights (bind() first)");
  const int r = lora_.r;
  bf16* xa = e.xa + expert_xa_at_;
  // xa [rows, r] = x A_e^T; y [rows, out] += scale xa B_e^T
  grouped_linear(xa, x, buf_.weights(e.a), offsets, groups, rows, e.in, r, s);
  grouped_linear(y, xa, buf_.weights(e.b), offsets, groups, rows, r, e.out, s, scale_,
                 /*accumulate=*/true);
}

void LoraCuda::expert_backward(int layer, int et, const bf16* x, const bf16* dy, bf16* dx,
                               const int* offsets, int groups, int rows, cudaStream_t s) {
  const ExpertSlot& e = expert_slot(layer, et, groups, rows);
  if (e.xa == nullptr) return;
  QT_CHECK(buf_.has_grads(), "LoRA backward without adapter weights and gradients (bind() first)");
  const int r = lora_.r;
  // gy [rows, r] = scale dy B_e; dB_e [out, r] += scale dy^T xa
  grouped_linear_backward(gy_, buf_.grads(e.b), dy, e.xa + expert_xa_at_, buf_.weights(e.b),
                          offsets, groups, rows, r, e.out, s, /*accumulate=*/true, scale_);
  // dA_e [r, in] += gy^T x; dx [rows, in] += gy A_e
  grouped_linear_backward(dx, buf_.grads(e.a), gy_, x, buf_.weights(e.a), offsets, groups, rows,
                          e.in, r, s, /*accumulate=*/true, 1.f, /*accumulate_dx=*/true);
}

}  // namespace qt::cuda
