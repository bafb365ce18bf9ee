// GEMM through cuBLASLt. Row-major C[M,N] = op(A) op(B) is computed as the column-major product
// C^T[N,M] = op(B)^T op(A)^T: a row-major [r, c] buffer with leading dimension ld is the
// column-major [c, r] matrix with the same ld, so B's buffer is cuBLASLt's "A" and A's is its "B",
// each with the caller's transpose flag, and no data moves.
#include "cuda/gemm.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "cuda/check.h"
#include "cuda/cublas_check.h"

namespace qt::cuda {

struct GemmContext::Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;  // cuBLASLt's A (= our B), B, C
  cublasLtMatmulAlgo_t algo{};
  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (c != nullptr) cublasLtMatrixLayoutDestroy(c);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (op != nullptr) cublasLtMatmulDescDestroy(op);
  }
};

namespace {

// Largest power of two (up to 16) dividing the address: the alignment cuBLASLt may assume.
int pointer_alignment(const void* p) {
  const auto v = reinterpret_cast<std::uintptr_t>(p);
  int a = 16;
  while (a > 1 && v % static_cast<std::uintptr_t>(a) != 0) a /= 2;
  return a;
}

std::string describe(const GemmArgs& g) {
  return fmt::format("gemm(trans_a={}, trans_b={}, M={}, N={}, K={}, lda={}, ldb={}, ldc={}, C {})",
                     g.trans_a, g.trans_b, g.M, g.N, g.K, g.lda, g.ldb, g.ldc,
                     g.c_is_f32 ? "fp32" : "bf16");
}

[[noreturn]] void bad_arg(const GemmArgs& g, const std::string& what) {
  throw std::invalid_argument(fmt::format("qt::cuda::{}: {}", describe(g), what));
}

void validate(const GemmArgs& g) {
  if (g.M < 0 || g.N < 0 || g.K < 0) bad_arg(g, "negative dimension");
  // Row lengths of the row-major buffers: A [M,K] or [K,M], B [K,N] or [N,K], C [M,N].
  const int a_row = g.trans_a ? g.M : g.K;
  const int b_row = g.trans_b ? g.K : g.N;
  if (g.lda < std::max(1, a_row)) bad_arg(g, fmt::format("lda must be >= {}", std::max(1, a_row)));
  if (g.ldb < std::max(1, b_row)) bad_arg(g, fmt::format("ldb must be >= {}", std::max(1, b_row)));
  if (g.ldc < std::max(1, g.N)) bad_arg(g, fmt::format("ldc must be >= {}", std::max(1, g.N)));
  if (g.M == 0 || g.N == 0) return;
  if (g.C == nullptr) bad_arg(g, "C is null");
  if (g.K > 0 && (g.A == nullptr || g.B == nullptr)) bad_arg(g, "A or B is null");
  const int c_size = g.c_is_f32 ? 4 : 2;
  if (g.K > 0 && pointer_alignment(g.A) < 2)
    bad_arg(g, fmt::format("A ({}) is not aligned to 2 bytes (bf16)", static_cast<const void*>(g.A)));
  if (g.K > 0 && pointer_alignment(g.B) < 2)
    bad_arg(g, fmt::format("B ({}) is not aligned to 2 bytes (bf16)", static_cast<const void*>(g.B)));
  if (pointer_alignment(g.C) < c_size)
    bad_arg(g, fmt::format("C ({}) is not aligned to {} bytes", g.C, c_size));
}

// One context per device index. Never destroyed: at exit the CUDA runtime may already be gone,
// and the driver frees the handles and workspaces with the process.
std::mutex g_contexts_mutex;
auto& g_contexts = *new std::vector<std::unique_ptr<GemmContext>>();

int current_device() {
  int d = 0;
  QT_CHECK_CUDA(cudaGetDevice(&d));
  return d;
}

}  // namespace

GemmContext::GemmContext(void* workspace, std::size_t workspace_bytes)
    : device_(current_device()), workspace_(workspace), workspace_bytes_(workspace_bytes) {
  if (workspace_ == nullptr && workspace_bytes_ > 0) {
    own_workspace_ = DeviceBuffer(workspace_bytes_, "cuBLASLt workspace");
    workspace_ = own_workspace_.get();
  }
  QT_CHECK_CUBLAS(cublasLtCreate(&handle_));
}

GemmContext::~GemmContext() {
  plans_.clear();
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

GemmContext& GemmContext::current() {
  const int d = current_device();
  std::lock_guard<std::mutex> lock(g_contexts_mutex);
  if (static_cast<int>(g_contexts.size()) <= d) g_contexts.resize(d + 1);
  if (!g_contexts[d]) g_contexts[d] = std::make_unique<GemmContext>(nullptr, kGemmWorkspaceBytes);
  return *g_contexts[d];
}

void GemmContext::install(void* workspace, std::size_t workspace_bytes) {
  const int d = current_device();
  QT_CHECK_CUDA(cudaDeviceSynchronize());  // no GEMM may still use the old workspace
  std::lock_guard<std::mutex> lock(g_contexts_mutex);
  if (static_cast<int>(g_contexts.size()) <= d) g_contexts.resize(d + 1);
  g_contexts[d].reset();
  g_contexts[d] = std::make_unique<GemmContext>(workspace, workspace_bytes);
}

std::size_t GemmContext::plan_count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return plans_.size();
}

std::vector<cublasLtMatmulHeuristicResult_t> GemmContext::heuristics(const Key& k, const Plan& p,
                                                                    int max_algos) const {
  cublasLtMatmulPreference_t pref = nullptr;
  QT_CHECK_CUBLAS(cublasLtMatmulPreferenceCreate(&pref));
  const std::uint64_t ws = workspace_bytes_;
  const std::uint32_t al_a = k.align_b, al_b = k.align_a, al_c = k.align_c;  // swapped roles
  QT_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  QT_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof al_a));
  QT_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof al_b));
  QT_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof al_c));
  QT_CHECK_CUBLAS(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof al_c));
  std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<std::size_t>(max_algos));
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(handle_, p.op, p.a, p.b, p.c, p.c, pref,
                                                           max_algos, results.data(), &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS) found = 0;
  results.resize(static_cast<std::size_t>(found));
  return results;
}

GemmContext::Plan& GemmContext::plan_for(const Key& k) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = plans_.find(k);
  if (it != plans_.end()) return *it->second;

  auto p = std::make_unique<Plan>();
  // cuBLASLt's problem: m = N, n = M, k = K; its A is our B, its B is our A.
  const cublasOperation_t op_a = k.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = k.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  QT_CHECK_CUBLAS(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  QT_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof op_a));
  QT_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof op_b));
  const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_DEFAULT;  // GemmEpilogue::kNone
  QT_CHECK_CUBLAS(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
  // Column-major layouts (rows, cols, ld) of the stored buffers, before the transpose flags.
  const std::uint64_t m = k.N, n = k.M, kk = k.K;
  QT_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, k.trans_b ? kk : m,
                                             k.trans_b ? m : kk, k.ldb));
  QT_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, k.trans_a ? n : kk,
                                             k.trans_a ? kk : n, k.lda));
  QT_CHECK_CUBLAS(cublasLtMatrixLayoutCreate(&p->c, k.c_is_f32 ? CUDA_R_32F : CUDA_R_16BF, m, n,
                                             k.ldc));

  const std::vector<cublasLtMatmulHeuristicResult_t> found = heuristics(k, *p, 1);
  if (found.empty()) {
    const std::string what = fmt::format(
        "no cuBLASLt algorithm for gemm(trans_a={}, trans_b={}, M={}, N={}, K={}, lda={}, ldb={}, "
        "ldc={}, C {}, alignment A/B/C {}/{}/{} bytes, workspace {} bytes)",
        k.trans_a, k.trans_b, k.M, k.N, k.K, k.lda, k.ldb, k.ldc, k.c_is_f32 ? "fp32" : "bf16",
        k.align_a, k.align_b, k.align_c, workspace_bytes_);
    fail_library("cuBLASLt", __FILE__, __LINE__, "cublasLtMatmulAlgoGetHeuristic", what.c_str());
  }
  p->algo = found[0].algo;
  return *plans_.emplace(k, std::move(p)).first->second;
}

void GemmContext::matmul(const GemmArgs& g, cudaStream_t stream) {
  validate(g);
  if (g.M == 0 || g.N == 0) return;
  if (g.K == 0) {  // C = beta * C: nothing to multiply
    if (g.beta == 1.f) return;
    if (g.beta != 0.f) bad_arg(g, "K = 0 is supported only with beta = 0 or 1");
    const std::size_t es = g.c_is_f32 ? 4 : 2;
    QT_CHECK_CUDA(cudaMemset2DAsync(g.C, g.ldc * es, 0, g.N * es, g.M, stream));
    return;
  }
  const Plan& p = plan_for(key_of(g));
  QT_CHECK_CUBLAS(cublasLtMatmul(handle_, p.op, &g.alpha, g.B, p.a, g.A, p.b, &g.beta, g.C, p.c,
                                 g.C, p.c, &p.algo, workspace_, workspace_bytes_, stream));
}

GemmContext::Key GemmContext::key_of(const GemmArgs& g) {
  return Key{g.trans_a, g.trans_b, g.c_is_f32, g.M, g.N, g.K, g.lda, g.ldb, g.ldc,
             pointer_alignment(g.A), pointer_alignment(g.B), pointer_alignment(g.C), g.epilogue};
}

std::vector<float> GemmContext::tune(const GemmArgs& g, cudaStream_t stream, int max_algos,
                                     int reps) {
  validate(g);
  if (g.M == 0 || g.N == 0 || g.K == 0) return {};
  Plan& p = plan_for(key_of(g));
  const std::vector<cublasLtMatmulHeuristicResult_t> algos = heuristics(key_of(g), p, max_algos);
  std::vector<float> ms(algos.size(), -1.f);
  Event start(true), stop(true);
  int best = -1;
  for (std::size_t i = 0; i < algos.size(); ++i) {
    if (algos[i].state != CUBLAS_STATUS_SUCCESS || algos[i].workspaceSize > workspace_bytes_) continue;
    auto run = [&] {
      return cublasLtMatmul(handle_, p.op, &g.alpha, g.B, p.a, g.A, p.b, &g.beta, g.C, p.c, g.C,
                            p.c, &algos[i].algo, workspace_, workspace_bytes_, stream);
    };
    if (run() != CUBLAS_STATUS_SUCCESS) continue;  // warm-up; an algorithm may still refuse
    start.record(stream);
    for (int r = 0; r < reps; ++r) QT_CHECK_CUBLAS(run());
    stop.record(stream);
    stop.synchronize();
    ms[i] = stop.elapsed_ms_since(start) / static_cast<float>(reps);
    if (best < 0 || ms[i] < ms[best]) best = static_cast<int>(i);
  }
  if (best >= 0) {
    std::lock_guard<std::mutex> lock(mutex_);
    p.algo = algos[best].algo;
  }
  return ms;
}

// ---- Entry points of src/ops/cuda/gemm.cuh ---------------------------------------------------------

void gemm_init(void* workspace, std::size_t workspace_bytes) {
  GemmContext::install(workspace, workspace_bytes);
}

void gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const bf16* A, int lda,
          const bf16* B, int ldb, float beta, bf16* C, int ldc, cudaStream_t stream) {
  GemmContext::current().matmul(
      GemmArgs{trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, false}, stream);
}

void gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha, const bf16* A, int lda,
          const bf16* B, int ldb, float beta, float* C, int ldc, cudaStream_t stream) {
  GemmContext::current().matmul(
      GemmArgs{trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, true}, stream);
}

void linear_forward(bf16* y, const bf16* x, const bf16* w, int N, int in, int out,
                    cudaStream_t stream) {
  // y[N, out] = x[N, in] * w[out, in]^T
  gemm(false, true, N, out, in, 1.f, x, in, w, in, 0.f, y, out, stream);
}

void linear_backward(bf16* dx, float* dw, const bf16* dy, const bf16* x, const bf16* w, int N,
                     int in, int out, cudaStream_t stream, bool accumulate) {
  // dx[N, in] = dy[N, out] * w[out, in]
  if (dx != nullptr) gemm(false, false, N, in, out, 1.f, dy, out, w, in, 0.f, dx, in, stream);
  // dw[out, in] += dy[N, out]^T * x[N, in]
  if (dw != nullptr)
    gemm(true, false, out, in, N, 1.f, dy, out, x, in, accumulate ? 1.f : 0.f, dw, in, stream);
}

}  // namespace qt::cuda
