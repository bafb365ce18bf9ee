// CudaOps: the layer program's ops as the kernels of src/ops/cuda. Shapes as in
// layer_program.h: N = B*T rows, H hidden, hd head_dim, V vocabulary.
#include "cuda/cuda_ops.h"

#include <algorithm>
#include <vector>

#include "cuda/check.h"
#include "cuda/lora_cuda.h"
#include "ops/cuda/attention.cuh"
#include "ops/cuda/convert.cuh"
#include "ops/cuda/cross_entropy.cuh"
#include "ops/cuda/embedding.cuh"
#include "ops/cuda/gemm.cuh"
#include "ops/cuda/qk_norm_rope.cuh"
#include "ops/cuda/rmsnorm.cuh"
#include "ops/cuda/swiglu.cuh"
#include "ops/rope.h"

namespace qt::cuda {

namespace {
// bf16 logits per lm-head chunk. Each chunk's weight-gradient GEMM reads and writes the whole fp32
// lm-head gradient (1.2 GB for Qwen3-1.7B), so fewer, larger chunks move less: 1 GiB (3533 rows
// of Qwen3's vocabulary) ran 1.9% (1.7B) and 3.5% (8B-shaped layers) faster than 256 MiB on an
// H100; all 8192 rows (2.5 GB) gained only 0.1% more (docs/performance.md).
constexpr std::size_t kLogitsChunkBytes = std::size_t{1} << 30;
}  // namespace

CudaOps::CudaOps(const ModelConfig& cfg, ForwardOnly f, DeviceArena& arena)
    : cfg_(cfg), B_(1), T_(1), N_(1), forward_only_(true), rope_len_(f.rope_len) {
  QT_CHECK(cfg.head_dim == 64 || cfg.head_dim == 128,
           "the CUDA attention supports head_dim 64 and 128, not {}", cfg.head_dim);
  std::vector<float> cos(static_cast<std::size_t>(f.rope_len) * cfg.head_dim / 2), sin(cos.size());
  cpu::rope_table(cos.data(), sin.data(), f.rope_len, cfg);
  cos_ = arena.allocate<float>(cos.size());
  sin_ = arena.allocate<float>(sin.size());
  upload(cos_, cos.data(), cos.size() * 4);
  upload(sin_, sin.data(), sin.size() * 4);
  if (cfg.is_moe()) {
    // Qwen3-MoE: the block's forward buffers for calls of up to rope_len rows (one shared set of
    // expert activations, as with recompute), in an arena of their own sized by counting them
    // (the caller's arena is sized for its own list). Generation routes dropless.
    N_ = f.rope_len;
    moe_recompute_ = true;
    ArenaCarver count(nullptr);
    moe_allocate(count);
    moe_arena_ = std::make_unique<DeviceArena>(count.bytes(), "Qwen3-MoE forward buffers");
    ArenaCarver carve(moe_arena_.get());
    moe_allocate(carve);
    N_ = 1;
  }
}

void CudaOps::set_rows(int B, int T, int first_position) {
  QT_CHECK(forward_only_, "set_rows is for forward-only CudaOps");
  QT_CHECK(B >= 1 && T >= 1 && first_position >= 0 && first_position + T <= rope_len_,
           "{} x {} rows from position {} past the RoPE tables' {}", B, T, first_position,
           rope_len_);
  B_ = B;
  T_ = T;
  N_ = B * T;
  rope_first_ = first_position;
}

CudaOps::CudaOps(const ModelConfig& cfg, int B, int T, DeviceArena& arena, NcclComm* tp,
                 int seq_parallel, bool tp_overlap, bool moe_recompute, NcclComm* ep,
                 const std::vector<int>& moe_slots, bool lm_head)
    : moe_slots_(moe_slots),
      ep_(ep && ep->size() > 1 ? ep : nullptr),
      cfg_(cfg), B_(B), T_(T), N_(B * T), rope_len_(T), tp_(tp && tp->size() > 1 ? tp : nullptr),
      overlap_(tp_overlap) {
  QT_CHECK(seq_parallel == 1 || (tp_ && tp_->size() == seq_parallel && N_ % seq_parallel == 0),
           "sequence parallelism over {} ranks of {} rows, tp {}", seq_parallel, N_,
           tp_ ? tp_->size() : 1);
  sp_ = seq_parallel > 1;
  QT_CHECK(cfg.head_dim == 64 || cfg.head_dim == 128,
           "the CUDA attention supports head_dim 64 and 128, not {}", cfg.head_dim);
  const int hd = cfg.head_dim, nh = cfg.num_heads, nkv = cfg.num_kv_heads;
  const std::size_t V = cfg.vocab_size;
  std::vector<float> cos(static_cast<std::size_t>(T) * hd / 2), sin(cos.size());
  cpu::rope_table(cos.data(), sin.data(), T, cfg);
  cos_ = arena.allocate<float>(cos.size());
  sin_ = arena.allocate<float>(sin.size());
  upload(cos_, cos.data(), cos.size() * 4);
  upload(sin_, sin.data(), sin.size() * 4);
  if (lm_head) {  // the lm head's logits a chunk of rows at a time, and the loss
    chunk_ = static_cast<int>(
        std::clamp<std::size_t>(kLogitsChunkBytes / (V * 2), 1, static_cast<std::size_t>(N_)));
    logits_ = arena.allocate<bf16>(static_cast<std::size_t>(chunk_) * V);
    losses_ = arena.allocate<float>(chunk_);
    chunk_lse_ = arena.allocate<float>(chunk_);
    loss_sum_ = arena.allocate<double>(1);
  }
  ws_bytes_ = std::max({rmsnorm_backward_workspace_bytes(N_, cfg.hidden_size),
                        qk_norm_rope_backward_workspace_bytes(B, T, nh, hd),
                        qk_norm_rope_backward_workspace_bytes(B, T, nkv, hd),
                        embedding_backward_workspace_bytes(N_)});
  ws_ = arena.allocate(ws_bytes_);
  if (tp_ && lm_head) {
    vocab_begin_ = tp_->rank() * cfg.vocab_size;
    vp_part_ = arena.allocate<float>(2 * static_cast<std::size_t>(chunk_));
    vp_parts_ = arena.allocate<float>(2 * static_cast<std::size_t>(chunk_) * tp_->size());
    vp_targets_ = arena.allocate<std::int32_t>(chunk_);
  }
  if (tp_ && overlap_)
    for (int i = 0; i < tp_->size(); ++i) landed_.push_back(std::make_unique<Event>());
  if (sp_) {
    const std::size_t NH = static_cast<std::size_t>(N_) * cfg.hidden_size;
    rows_full_ = arena.allocate<bf16>(NH);
    xf_full_ = arena.allocate<bf16>(NH);
    if (overlap_) parts_ = arena.allocate<bf16>(NH / seq_parallel * (seq_parallel - 1));
  }
  moe_recompute_ = moe_recompute;
  if (cfg.is_moe()) {
    ArenaCarver carve(&arena);
    moe_allocate(carve);
    if (ep_) moe_ep_allocate(arena);
  }
}

template <class Issue>
void CudaOps::tp_run(Issue issue, cudaEvent_t after) {
  if (after == nullptr) {
    tp_ready_.record(s_);
    after = tp_ready_.get();
  }
  tp_->wait_event(after);
  issue();
  tp_done_.record(tp_->stream());
  QT_CHECK_CUDA(cudaStreamWaitEvent(s_, tp_done_.get(), 0));
}

void CudaOps::tp_all_reduce(void* buf, std::size_t n, DType t, cudaEvent_t after) {
  tp_run([&] { tp_->all_reduce_async(buf, n, t, ReduceOp::kSum); }, after);
}

void CudaOps::gather_rows(bf16* full, const bf16* x, int rows, int cols) {
  const std::size_t part = static_cast<std::size_t>(rows / tp_->size()) * cols;
  tp_run([&] { tp_->all_gather_async(x, full, part, DType::kBF16); });
}

void CudaOps::scatter_rows(bf16* local, const bf16* y, int rows, int cols, cudaEvent_t after) {
  const std::size_t part = static_cast<std::size_t>(rows / tp_->size()) * cols;
  tp_run([&] { tp_->reduce_scatter_async(y, local, part, DType::kBF16, ReduceOp::kSum); }, after);
}

void CudaOps::begin(cudaStream_t s, const std::int32_t* pos) {
  s_ = s;
  pos_ = pos;
  if (loss_sum_) QT_CHECK_CUDA(cudaMemsetAsync(loss_sum_, 0, sizeof(double), s_));
}

double CudaOps::take_loss() {
  double loss = 0;  // a pipeline stage without the head has none, but waits all the same
  if (loss_sum_)
    QT_CHECK_CUDA(cudaMemcpyAsync(&loss, loss_sum_, sizeof(double), cudaMemcpyDeviceToHost, s_));
  QT_CHECK_CUDA(cudaStreamSynchronize(s_));
  return loss;
}

void CudaOps::linear(bf16* y, const bf16* x, const bf16* w, int N, int in, int out) {
  QT_CHECK(ahead_.y == nullptr || ahead_.y == y, "tp_block_output_ahead names another output");
  if (ahead_.y) return linear_reduced(y, x, w, N, in, out);
  if (gathered_) return linear_gathered(y, x, w, N, in, out);
  linear_forward(y, x, w, N, in, out, s_);
}

// dx first: with tp marked, so that its reduction runs beside the weight gradient's GEMM.
void CudaOps::linear_backward(bf16* dx, float* dw, const bf16* dy, const bf16* x, const bf16* w,
                              int N, int in, int out, bool acc) {
  if (gathered_) {
    input_grad_gathered(dx, dy, w, N, in, out);
  } else if (dx != nullptr) {
    cuda::linear_backward(dx, nullptr, dy, nullptr, w, N, in, out, s_);
    if (tp_) {
      dx_done_.record(s_);
      dx_pending_ = dx;
    }
  }
  weight_grad(dw, dy, x, N, in, out, acc);
}

void CudaOps::weight_grad(float* dw, const bf16* dy, const bf16* x, int N, int in, int out,
                          bool acc) {
  if (dw == nullptr) return;
  if (defer_ == nullptr) return cuda::linear_backward(nullptr, dw, dy, x, nullptr, N, in, out, s_, acc);
  DeferredGrads& q = *defer_;
  const std::size_t n = static_cast<std::size_t>(N) * out;
  const auto at = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p); };
  if (at(dy) < at(q.keep_begin) || at(dy) >= at(q.keep_end)) {  // scratch the next ops rewrite
    QT_CHECK(q.used + n <= q.capacity, "deferred weight gradients need more than {} elements",
             q.capacity);
    QT_CHECK_CUDA(cudaMemcpyAsync(q.store + q.used, dy, n * sizeof(bf16),
                                  cudaMemcpyDeviceToDevice, s_));
    dy = q.store + q.used;
    q.used += n;
  }
  q.gemms.push_back({dw, dy, x, N, in, out, acc});
}

void CudaOps::run_deferred(DeferredGrads& q) {
  for (const DeferredGrads::Gemm& g : q.gemms)
    cuda::linear_backward(nullptr, g.dw, g.dy, g.x, nullptr, g.N, g.in, g.out, s_, g.acc);
  q.gemms.clear();
  q.used = 0;
}

void CudaOps::qk_norm_rope(bf16* out, float* rstd, const bf16* x, int ld, const bf16* w,
                           int heads) {
  // From position rope_first_ on (0 in training): the kernel's row t is position first + t.
  const std::size_t first = static_cast<std::size_t>(rope_first_) * cfg_.head_dim / 2;
  qk_norm_rope_forward_strided(out, rstd, x, ld, w, cos_ + first, sin_ + first, pos_, B_, T_,
                               heads, cfg_.head_dim, cfg_.rms_norm_eps, s_);
}

void CudaOps::qk_norm_rope_backward(bf16* dx, int dx_ld, float* dw, const bf16* dout,
                                    const bf16* x, int ld, const bf16* w, const float* rstd,
                                    int heads, bool acc) {
  qk_norm_rope_backward_strided(dx, dx_ld, dw, dout, x, ld, w, rstd, cos_, sin_, pos_, B_, T_,
                                heads, cfg_.head_dim, ws_, s_, acc);
}

void CudaOps::copy_columns(bf16* dst, int dst_ld, const bf16* src, int src_ld, int rows,
                           int cols) {
  const std::size_t e = sizeof(bf16);
  QT_CHECK_CUDA(cudaMemcpy2DAsync(dst, dst_ld * e, src, src_ld * e, cols * e, rows,
                                  cudaMemcpyDeviceToDevice, s_));
}

void CudaOps::attention(int, bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v) {
  attention_forward(out, lse, q, k, v, B_, T_, cfg_.num_heads, cfg_.num_kv_heads, cfg_.head_dim,
                    s_, pos_);
}

void CudaOps::attention_backward(int, bf16* dq, bf16* dk, bf16* dv, const bf16* dout,
                                 const bf16* q, const bf16* k, const bf16* v, const bf16* out,
                                 const float* lse) {
  cuda::attention_backward(dq, dk, dv, dout, q, k, v, out, lse, B_, T_, cfg_.num_heads,
                           cfg_.num_kv_heads, cfg_.head_dim, s_, pos_);
}

void CudaOps::rmsnorm(bf16* y, float* rstd, const bf16* x, const bf16* w, int N) {
  rmsnorm_forward(y, rstd, x, w, N, cfg_.hidden_size, cfg_.rms_norm_eps, s_);
}

void CudaOps::rmsnorm_backward(bf16* dx, float* dw, const bf16* dy, const bf16* x, const bf16* w,
                               const float* rstd, int N, bool acc) {
  cuda::rmsnorm_backward(dx, dw, dy, x, w, rstd, N, cfg_.hidden_size, ws_, s_, acc);
}

void CudaOps::residual_rmsnorm(bf16* res_out, bf16* y, float* rstd, const bf16* res_in,
                               const bf16* x, const bf16* w, int N) {
  residual_rmsnorm_forward(res_out, y, rstd, res_in, x, w, N, cfg_.hidden_size,
                           cfg_.rms_norm_eps, s_);
}

void CudaOps::residual_rmsnorm_backward(bf16* dres, float* dw, const bf16* dy, const bf16* x,
                                        const bf16* w, const float* rstd, int N, bool acc) {
  cuda::residual_rmsnorm_backward(dres, dw, dy, x, w, rstd, N, cfg_.hidden_size, ws_, s_, acc);
}

void CudaOps::residual_add(bf16* res_out, const bf16* res_in, const bf16* x, int N) {
  add_bf16(res_out, res_in, x, static_cast<std::size_t>(N) * cfg_.hidden_size, s_);
}

void CudaOps::swiglu(bf16* h, const bf16* gu, int N, int I) {
  swiglu_forward_strided(h, gu, gu + I, 2 * I, N, I, s_);
}

void CudaOps::swiglu_backward(bf16* dgu, const bf16* dh, const bf16* gu, int N, int I) {
  swiglu_backward_strided(dgu, dgu + I, dh, gu, gu + I, 2 * I, N, I, s_);
}

void CudaOps::embedding(bf16* x, const std::int32_t* ids, const bf16* wte, int N) {
  const int H = cfg_.hidden_size;
  if (!tp_) return embedding_forward(x, ids, wte, N, H, s_);
  // This rank's rows of the vocabulary, zeros elsewhere: exactly one rank adds each row (x is
  // this rank's N / tp rows of the sum with sequence parallelism).
  embedding_forward_rows(sp_ ? rows_full_ : x, ids, wte, N, H, vocab_begin_, cfg_.vocab_size, s_);
  if (sp_)
    scatter_rows(x, rows_full_, N, H);
  else
    tp_all_reduce(x, static_cast<std::size_t>(N) * H, DType::kBF16);
}

void CudaOps::embedding_backward(float* dwte, const bf16* dx, const std::int32_t* ids, int N,
                                 bool overwrite) {
  const std::size_t H = cfg_.hidden_size, rows = cfg_.vocab_size;
  if (overwrite) QT_CHECK_CUDA(cudaMemsetAsync(dwte, 0, sizeof(float) * rows * H, s_));
  if (!tp_) return cuda::embedding_backward(dwte, dx, ids, N, H, ws_, ws_bytes_, s_);
  // Sequence parallelism: every row's gradient, gathered. The table's flat range of this rank's
  // rows: other ids fall outside it.
  if (sp_) gather_rows(rows_full_, dx, N, static_cast<int>(H));
  const std::size_t lo = static_cast<std::size_t>(vocab_begin_) * H;
  embedding_backward_range(dwte, lo, lo + rows * H, sp_ ? rows_full_ : dx, ids, N, H, ws_,
                           ws_bytes_, s_);
}

bool CudaOps::lora_adapts(LoraSite site) const { return lora_ && lora_->adapts(site); }

void CudaOps::lora(int l, LoraSite site, const bf16* x, bf16* y) {
  if (lora_) lora_->forward(l, site, x, y, s_);
}

void CudaOps::lora_backward(int l, LoraSite site, const bf16* x, const bf16* dy, bf16* dx) {
  if (!lora_) return;
  lora_->backward(l, site, x, dy, dx, s_);
  dx_pending_ = nullptr;  // dx changed after its GEMM
}

// Logits, loss and their backward, chunk by chunk; dxf [Nl, H] written (Nl: N, or this rank's
// N / tp rows with sequence parallelism: the rows are gathered first, their gradients summed
// over tp into this rank's at the end).
void CudaOps::lm_head_loss(const bf16* xf_in, const bf16* lm_head, float* g_lm_head,
                           const std::int32_t* targets, float scale, bf16* dxf_out, bool acc) {
  const int H = cfg_.hidden_size, V = cfg_.vocab_size;
  QT_CHECK(logits_ != nullptr, "the lm head's loss on ops made without the head's buffers");
  if (sp_) gather_rows(xf_full_, xf_in, N_, H);
  const bf16* xf = sp_ ? xf_full_ : xf_in;
  bf16* dxf = sp_ ? rows_full_ : dxf_out;
  for (int c0 = 0; c0 < N_; c0 += chunk_) {
    const int rows = std::min(chunk_, N_ - c0);
    const std::size_t r0 = static_cast<std::size_t>(c0);
    linear_forward(logits_, xf + r0 * H, lm_head, rows, H, V, s_);
    if (!tp_) {
      cross_entropy_forward_backward(losses_, chunk_lse_, logits_, targets + r0, scale, rows, V,
                                     loss_sum_, s_);
      cuda::linear_backward(dxf + r0 * H, g_lm_head, logits_, xf + r0 * H, lm_head, rows, H, V,
                            s_, acc || c0 > 0);
      continue;
    }
    // Vocabulary-parallel: every rank's log-sum-exp and target logits of the chunk's rows, then
    // the gradient over this rank's columns; dx partial over tp (summed while dW runs).
    cross_entropy_vp_partial(vp_part_, logits_, targets + r0, rows, V, vocab_begin_, s_);
    tp_run([&] {
      tp_->all_gather_async(vp_part_, vp_parts_, 2 * static_cast<std::size_t>(rows), DType::kF32);
    });
    cross_entropy_vp_finish(losses_, chunk_lse_, vp_targets_, vp_parts_, tp_->size(),
                            targets + r0, rows, V, vocab_begin_, loss_sum_, s_);
    cross_entropy_backward(logits_, logits_, chunk_lse_, vp_targets_, scale, rows, V, s_);
    linear_backward(dxf + r0 * H, g_lm_head, logits_, xf + r0 * H, lm_head, rows, H, V,
                    acc || c0 > 0);
    if (!sp_) tp_block_input_backward(nullptr, dxf + r0 * H, rows, H);
  }
  // Sequence parallelism: the whole [N, H] gradient summed over tp into this rank's rows, beside
  // the last chunk's weight-gradient GEMM.
  if (sp_) {
    const std::size_t last = static_cast<std::size_t>((N_ - 1) / chunk_) * chunk_;  // its row 0
    scatter_rows(dxf_out, rows_full_, N_, H, take_dx_event(rows_full_ + last * H));
  }
}

}  // namespace qt::cuda
