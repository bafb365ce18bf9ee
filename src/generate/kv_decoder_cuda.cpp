// Qwen3 forward with a bf16 key/value cache on the GPU (kv_decoder_cuda.h). CUDA host code:
// compiled only with QTRAIN_CUDA (CMakeLists.txt takes every src/*/*_cuda.cpp into the CUDA
// sources). Shapes: n new rows; H hidden; Q = nh*hd; KV = nkv*hd; QKV = Q + 2 KV; I intermediate;
// V vocabulary; cap cache positions.
#include "generate/kv_decoder_cuda.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/cuda_ops.h"
#include "model/layer_program.h"
#include "ops/cuda/attention.cuh"
#include "ops/cuda/decode_attention.cuh"
#include "ops/cuda/gemm.cuh"
#include "qtrain/error.h"
#include "qtrain/params.h"

namespace qt::gen {

namespace {

using cuda::bf16;

// Pinned host memory (fast, truly asynchronous copies), grown on demand; contents not kept.
template <typename T>
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() {
    if (p_ != nullptr) cudaFreeHost(p_);
  }
  T* reserve(std::size_t n) {
    if (n > n_) {
      if (p_ != nullptr) QT_CHECK_CUDA(cudaFreeHost(p_));
      p_ = nullptr;
      QT_CHECK_CUDA(cudaMallocHost(reinterpret_cast<void**>(&p_), n * sizeof(T)));
      n_ = n;
    }
    return p_;
  }

 private:
  T* p_ = nullptr;
  std::size_t n_ = 0;
};

// The size of the scratch arena and the blocks carved from it come from one list.
using Carver = cuda::ArenaCarver;

// The device buffers of one append of n rows (logits for `rows` of them).
struct Scratch {
  std::int32_t* ids;        // [n]
  bf16 *x, *ln, *tmp;       // [n, H]: residual stream, norm output, GEMM output
  float* rstd;              // [n]
  bf16* qkv;                // [n, QKV] rows [q | k | v] before q/k norm
  bf16 *q, *k, *v;          // [n, Q], [n, KV], [n, KV] after norm and rope, before the cache
  float *q_rstd, *k_rstd;   // [n * nh], [n * nkv]
  bf16* att;                // [n, Q]
  float* lse;               // [nh, n] (prefill)
  bf16 *gu, *h;             // [n, 2 I], [n, I]
  float* moe_probs;         // Qwen3-MoE: [n, E] the router's probabilities
  int* moe_idx;             // [n, k] its choice
  bf16* moe_w;              // [n, k] routing weights
  float* logits;            // [rows, V]
  void* attn_ws;            // decode_attention workspace (len > 0)
  std::size_t attn_ws_bytes;
};

Scratch carve(Carver& c, const ModelConfig& m, int n, int rows, int len) {
  const std::size_t N = n, H = m.hidden_size, Q = m.q_dim(), KV = m.kv_dim();
  const std::size_t I = m.intermediate_size;
  Scratch s{};
  s.ids = c.take<std::int32_t>(N);
  s.x = c.take<bf16>(N * H);
  s.ln = c.take<bf16>(N * H);
  s.tmp = c.take<bf16>(N * H);
  s.rstd = c.take<float>(N);
  s.qkv = c.take<bf16>(N * (Q + 2 * KV));
  s.q = c.take<bf16>(N * Q);
  s.k = c.take<bf16>(N * KV);
  s.v = c.take<bf16>(N * KV);
  s.q_rstd = c.take<float>(N * m.num_heads);
  s.k_rstd = c.take<float>(N * m.num_kv_heads);
  s.att = c.take<bf16>(N * Q);
  s.lse = c.take<float>(len == 0 ? N * m.num_heads : 0);
  s.gu = c.take<bf16>(N * 2 * I);
  s.h = c.take<bf16>(N * I);
  const std::size_t E = m.num_experts, k = m.is_moe() ? m.num_experts_per_tok : 0;
  s.moe_probs = c.take<float>(N * E);
  s.moe_idx = c.take<int>(N * k);
  s.moe_w = c.take<bf16>(N * k);
  s.logits = c.take<float>(static_cast<std::size_t>(rows) * m.vocab_size);
  s.attn_ws_bytes = len == 0 ? 0
                             : cuda::decode_attention_workspace_bytes(
                                   n, m.num_heads, m.num_kv_heads, m.head_dim, len + n);
  s.attn_ws = c.take<char>(s.attn_ws_bytes);
  return s;
}

// The program's CUDA ops with attention over the cache. The cache is [nkv, cap, hd] per layer
// (head-major, for the decode kernel), so the program's k and v are [n, KV] rows of the scratch
// that this attention first stores in the cache (kv_cache_write); then on an empty cache (the
// prompt) the batched causal flash attention of training among the n rows, otherwise the
// flash-decoding kernel (decode_attention.cuh), query row i seeing positions [0, len + i]. The
// rest is CudaOps forward-only (RoPE from position len on).
class KvCudaOps : public cuda::CudaOps {
 public:
  KvCudaOps(const ModelConfig& cfg, int capacity, cuda::DeviceArena& arena)
      : CudaOps(cfg, ForwardOnly{capacity}, arena), cfg_(cfg), cap_(capacity) {}

  // The next call: n rows at positions len.., on `st`; the layers' caches k, v [L, nkv, cap, hd];
  // scratch s (its lse and decode workspace).
  void begin_call(cudaStream_t st, bf16* k, bf16* v, int len, int n, const Scratch& s) {
    begin(st, nullptr);
    set_rows(1, n, len);
    st_ = st;
    k_ = k;
    v_ = v;
    len_ = len;
    n_ = n;
    scratch_ = &s;
  }

  // Hides CudaOps::attention (the program is a template over the Ops type, not virtual).
  void attention(int l, bf16* out, float* /*lse*/, const bf16* q, const bf16* k, const bf16* v) {
    const int nh = cfg_.num_heads, nkv = cfg_.num_kv_heads, hd = cfg_.head_dim;
    const int KV = cfg_.kv_dim();
    const std::size_t per_layer = static_cast<std::size_t>(cap_) * KV;
    bf16* kc = k_ + l * per_layer;  // [nkv, cap, hd]
    bf16* vc = v_ + l * per_layer;
    cuda::kv_cache_write(kc, vc, k, KV, v, KV, n_, len_, nkv, hd, cap_, st_);
    if (len_ == 0)  // the whole sequence is new: causal attention among the n rows
      cuda::attention_forward(out, scratch_->lse, q, k, v, 1, n_, nh, nkv, hd, st_);
    else
      cuda::decode_attention(out, q, kc, vc, n_, len_, nh, nkv, hd, cap_, scratch_->attn_ws,
                             scratch_->attn_ws_bytes, st_);
  }

 private:
  ModelConfig cfg_;
  int cap_;
  cudaStream_t st_ = nullptr;
  bf16 *k_ = nullptr, *v_ = nullptr;
  int len_ = 0, n_ = 0;
  const Scratch* scratch_ = nullptr;
};

}  // namespace

// A model the CUDA ops cannot run is the user's to hear about, not an assertion.
void KvDecoderCuda::check_supported(const ModelConfig& c) {
  if (c.head_dim != 64 && c.head_dim != 128)
    fail_user("--device cuda supports head_dim 64 and 128 (the CUDA attention); this model has {} "
              "(--device cpu runs it)",
              c.head_dim);
  if (c.num_kv_heads < 1 || c.num_heads % c.num_kv_heads != 0 ||
      c.num_heads / c.num_kv_heads > 16)
    fail_user("--device cuda supports up to 16 query heads per kv head; this model has {} heads "
              "and {} kv heads",
              c.num_heads, c.num_kv_heads);
  if (c.hidden_size % 8 != 0 || c.hidden_size > 8192)
    fail_user("--device cuda needs a hidden size that is a multiple of 8 and at most 8192 (the "
              "CUDA RMSNorm); this model has {}",
              c.hidden_size);
  if (c.is_moe() && (c.num_experts > 1024 || c.num_experts_per_tok > 32))
    fail_user("--device cuda routes at most 1024 experts, 32 a token (the CUDA router); this "
              "model has {} experts, {} a token (--device cpu runs it)",
              c.num_experts, c.num_experts_per_tok);
}

struct KvDecoderCuda::Impl {
  Impl(const ModelConfig& c, const float* params, int capacity);
  const float* append(std::span<const std::int32_t> ids, bool all_logits);

  ModelConfig cfg;
  ParamLayout layout;
  ModelOffsets off = layout.model_offsets();
  int cap, len = 0;
  int device;  // made current before the stream and the arenas below are created
  cuda::Stream stream;
  std::unique_ptr<cuda::DeviceArena> arena;    // weights, cache, rope tables
  std::unique_ptr<cuda::DeviceArena> scratch;  // one call's buffers; regrown when a call needs more
  bf16* W = nullptr;                           // [numel] bf16 weights, flat layout
  bf16 *kc = nullptr, *vc = nullptr;           // [L, nkv, cap, hd] each
  std::unique_ptr<KvCudaOps> ops;              // the program's ops; RoPE tables for cap positions
  PinnedBuffer<std::int32_t> ids_host;
  PinnedBuffer<float> logits_host;
};

KvDecoderCuda::Impl::Impl(const ModelConfig& c, const float* params, int capacity)
    : cfg(c), layout(c), cap(capacity), device(cuda::select_device(0)) {
  check_supported(cfg);
  QT_CHECK(capacity >= 1, "cache capacity {} < 1", capacity);
  check_fused_layout(cfg, off);
  const std::size_t KV = cfg.kv_dim();
  const std::size_t numel = layout.numel(), half = static_cast<std::size_t>(cap) * c.head_dim / 2;
  const std::size_t cache = static_cast<std::size_t>(cfg.num_layers) * cap * KV;
  Carver count(nullptr);
  count.take<bf16>(numel);
  count.take<bf16>(cache);
  count.take<bf16>(cache);
  count.take<float>(half);
  count.take<float>(half);
  try {
    arena = std::make_unique<cuda::DeviceArena>(count.bytes(), "generate weights and cache");
    // First sized for the weights' staging block (cuda::upload_as_bf16), regrown by append().
    scratch = std::make_unique<cuda::DeviceArena>(cuda::kUploadStageFloats * sizeof(float),
                                                  "generate scratch");
  } catch (const cuda::OutOfMemory& e) {
    const cuda::DeviceMemory m = cuda::device_memory();
    fail_user(
        "the GPU has too little free memory for the model: {} of bf16 weights and {} of key/value "
        "cache for {} positions, {} free of {} ({}); lower --max-new-tokens to shrink the cache",
        cuda::format_bytes(numel * 2), cuda::format_bytes(2 * cache * 2), cap,
        cuda::format_bytes(m.free_bytes), cuda::format_bytes(m.total_bytes), e.what());
  }
  W = arena->allocate<bf16>(numel);
  kc = arena->allocate<bf16>(cache);
  vc = arena->allocate<bf16>(cache);
  ops = std::make_unique<KvCudaOps>(cfg, cap, *arena);  // its RoPE tables: the last two blocks
  cuda::upload_as_bf16(W, params, numel, *scratch, stream.get());
}

const float* KvDecoderCuda::Impl::append(std::span<const std::int32_t> ids, bool all_logits) {
  const int n = static_cast<int>(ids.size());
  const int H = cfg.hidden_size, V = cfg.vocab_size;
  QT_CHECK(n >= 1 && len + n <= cap, "append of {} tokens to a cache holding {} of {}", n, len,
           cap);
  for (int i = 0; i < n; ++i)
    QT_CHECK(ids[i] >= 0 && ids[i] < V, "token id {} at {} outside [0, {})", ids[i], i, V);
  const int rows = all_logits ? n : 1;
  QT_CHECK(scratch != nullptr, "the decoder is unusable after a failed allocation");
  Carver count(nullptr);
  carve(count, cfg, n, rows, len);
  if (count.bytes() > scratch->capacity()) {
    scratch.reset();  // the old block goes first: the new one may need its room
    try {
      scratch = std::make_unique<cuda::DeviceArena>(count.bytes(), "generate scratch");
    } catch (const cuda::OutOfMemory& e) {
      fail_user("the GPU has too little free memory for {} tokens at once: {}", n, e.what());
    }
  }
  cuda::DeviceArena::Scope scope(*scratch);
  Carver take(scratch.get());
  const Scratch s = carve(take, cfg, n, rows, len);
  const cudaStream_t st = stream.get();

  std::int32_t* ids_h = ids_host.reserve(n);
  std::copy(ids.begin(), ids.end(), ids_h);
  QT_CHECK_CUDA(cudaMemcpyAsync(s.ids, ids_h, n * sizeof(std::int32_t), cudaMemcpyHostToDevice, st));
  KvCudaOps& o = *ops;
  o.begin_call(st, kc, vc, len, n, s);
  const int L = cfg.num_layers;
  o.embedding(s.x, s.ids, W + off.embed, n);
  o.rmsnorm(s.ln, s.rstd, s.x, L > 0 ? W + off.layers[0].ln1 : W + off.norm, n);
  // The program's layers in place on s.x and s.ln (LayerIO's in-place form).
  const LayerIO<bf16> io{s.x, s.ln, s.x, s.ln, s.rstd, s.tmp};
  LayerActs<bf16> a{s.qkv, s.q_rstd, s.k_rstd, s.q, s.k, s.v, s.att, s.lse, s.x, s.ln, s.rstd,
                    s.gu, s.h, s.moe_probs, s.moe_idx, s.moe_w};
  for (int l = 0; l < L; ++l) {
    const bf16* next_norm = l + 1 < L ? W + off.layers[l + 1].ln1 : W + off.norm;
    qwen3_layer_forward(o, cfg, l, n, layer_tensors<const bf16>(off.layers[l], W), next_norm, io,
                        a);
  }
  // s.ln is the final norm of every row. The lm head only for the last `rows`, in fp32 (the
  // program's head is training's chunked lm head + cross-entropy over every row, so it stays
  // here).
  cuda::gemm(false, true, rows, V, H, 1.0f, s.ln + static_cast<std::size_t>(n - rows) * H, H,
             W + off.lm_head, H, 0.0f, s.logits, V, st);
  float* out = logits_host.reserve(static_cast<std::size_t>(rows) * V);
  QT_CHECK_CUDA(cudaMemcpyAsync(out, s.logits, static_cast<std::size_t>(rows) * V * sizeof(float),
                                cudaMemcpyDeviceToHost, st));
  stream.synchronize();
  len += n;
  return out;
}

KvDecoderCuda::KvDecoderCuda(const ModelConfig& cfg, const float* params, int capacity)
    : impl_(std::make_unique<Impl>(cfg, params, capacity)) {}
KvDecoderCuda::~KvDecoderCuda() = default;

const ModelConfig& KvDecoderCuda::config() const { return impl_->cfg; }
int KvDecoderCuda::length() const { return impl_->len; }
int KvDecoderCuda::capacity() const { return impl_->cap; }
void KvDecoderCuda::reset() { impl_->len = 0; }
const float* KvDecoderCuda::append(std::span<const std::int32_t> ids, bool all_logits) {
  return impl_->append(ids, all_logits);
}
std::size_t KvDecoderCuda::cache_bytes() const {
  return 2 * static_cast<std::size_t>(impl_->cfg.num_layers) * impl_->cap * impl_->cfg.kv_dim() *
         sizeof(bf16);
}
std::string KvDecoderCuda::device_description() const {
  return fmt::format("GPU {} ({})", impl_->device, cuda::device_info(impl_->device).name);
}
std::size_t KvDecoderCuda::device_bytes() const {
  return impl_->arena->capacity() + (impl_->scratch ? impl_->scratch->capacity() : 0) +
         impl_->ops->own_bytes();
}

}  // namespace qt::gen
