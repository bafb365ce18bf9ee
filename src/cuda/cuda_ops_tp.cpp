// CudaOps' tensor-parallel hooks and the overlap of their collectives with the block's GEMMs
// (cuda_ops.h says what runs beside what). Rows: N = B x T of the micro-batch, split into tp
// blocks of N / tp rows with sequence parallelism (block p is rank p's).
#include <algorithm>

#include "cuda/check.h"
#include "cuda/cuda_ops.h"
#include "ops/cuda/convert.cuh"
#include "ops/cuda/gemm.cuh"

namespace qt::cuda {

namespace {
// Row pieces of a row-parallel GEMM whose output is all-reduced (no sequence parallelism): each
// piece's all-reduce runs beside the next piece's GEMM; only the last one's stays exposed.
constexpr int kReducePieces = 4;
}  // namespace

cudaEvent_t CudaOps::take_dx_event(const bf16* dx) {
  const cudaEvent_t e = dx == dx_pending_ ? dx_done_.get() : nullptr;
  dx_pending_ = nullptr;
  return e;
}

bf16* CudaOps::tp_block_input(bf16* full, bf16* x, int rows, int cols) {
  if (!sp_) return x;
  if (overlap_)
    start_gather(full, x, rows, cols);  // the q/k/v or gate/up GEMM reads it as it lands
  else
    gather_rows(full, x, rows, cols);
  return full;
}

bf16* CudaOps::tp_block_input_backward(bf16* local, bf16* dx, int rows, int cols) {
  if (!tp_) return dx;
  // Right after dx's GEMM when the last linear_backward made it: the weight gradient's GEMM,
  // enqueued since, runs beside the reduction.
  const cudaEvent_t after = take_dx_event(dx);
  if (sp_) {
    scatter_rows(local, dx, rows, cols, after);
    return local;
  }
  tp_all_reduce(dx, static_cast<std::size_t>(rows) * cols, DType::kBF16, after);
  return dx;
}

void CudaOps::tp_block_output_ahead(bf16* local, bf16* y, int, int) {
  // With LoRA the adapter adds to y after the GEMM: the reduction waits for both (below).
  if (tp_ && overlap_ && !lora_) ahead_ = {local, y};
}

bf16* CudaOps::tp_block_output(bf16* local, bf16* y, int rows, int cols) {
  if (!tp_) return y;
  if (reduced_ == y) {  // linear_reduced did it
    reduced_ = nullptr;
    return sp_ ? local : y;
  }
  if (sp_) {
    scatter_rows(local, y, rows, cols);
    return local;
  }
  tp_all_reduce(y, static_cast<std::size_t>(rows) * cols, DType::kBF16);
  return y;
}

bf16* CudaOps::tp_block_output_backward(bf16* full, bf16* dy, int rows, int cols) {
  if (!sp_) return dy;
  if (overlap_)
    start_gather(full, dy, rows, cols);  // the o or down input-gradient GEMM reads it as it lands
  else
    gather_rows(full, dy, rows, cols);
  return full;
}

// Pairwise exchanges: in step i every rank sends its rows to rank r + i and receives rank
// r - i's (mod tp), one NCCL group a step, so the blocks land one by one.
void CudaOps::start_gather(bf16* full, const bf16* x, int rows, int cols) {
  QT_CHECK(rows == N_ && gathered_ == nullptr, "gather of {} rows (micro-batch {})", rows, N_);
  const int P = tp_->size(), r = tp_->rank();
  const std::size_t part = static_cast<std::size_t>(rows / P) * cols;
  QT_CHECK_CUDA(cudaMemcpyAsync(full + r * part, x, part * sizeof(bf16),
                                cudaMemcpyDeviceToDevice, s_));
  tp_ready_.record(s_);  // x written, full's earlier readers done
  tp_->wait_event(tp_ready_.get());
  for (int i = 1; i < P; ++i) {
    const int to = (r + i) % P, from = (r + P - i) % P;
    tp_->group_start();
    tp_->send_async(x, part, DType::kBF16, to);
    tp_->recv_async(full + from * part, part, DType::kBF16, from);
    tp_->group_end();
    landed_[i]->record(tp_->stream());
  }
  gathered_ = full;
}

template <class Gemm>
void CudaOps::over_landed_rows(Gemm gemm) {
  const int P = tp_->size(), r = tp_->rank(), part = N_ / P;
  gemm(r * part, part);  // copied on this stream
  for (int i = 1; i < P; ++i) {
    QT_CHECK_CUDA(cudaStreamWaitEvent(s_, landed_[i]->get(), 0));
    gemm((r + P - i) % P * part, part);
  }
  gathered_ = nullptr;  // the stream has waited for every block (and so for this rank's sends)
}

void CudaOps::linear_gathered(bf16* y, const bf16* x, const bf16* w, int N, int in, int out) {
  QT_CHECK(x == gathered_ && N == N_, "a gathered block input is read by the GEMM right after it");
  const std::size_t i = in, o = out;
  over_landed_rows([&](int r0, int rows) {
    linear_forward(y + r0 * o, x + r0 * i, w, rows, in, out, s_);
  });
}

void CudaOps::input_grad_gathered(bf16* dx, const bf16* dy, const bf16* w, int N, int in,
                                  int out) {
  QT_CHECK(dy == gathered_ && N == N_, "a gathered output gradient is read by the GEMM right "
           "after it");
  const std::size_t i = in, o = out;
  over_landed_rows([&](int r0, int rows) {
    if (dx) cuda::linear_backward(dx + r0 * i, nullptr, dy + r0 * o, nullptr, w, rows, in, out, s_);
  });  // every row landed: the weight gradient may read dy
}

void CudaOps::wait_gathered(const bf16* x) {
  if (gathered_ == nullptr) return;
  QT_CHECK(x == gathered_, "a gathered buffer is read by the op right after its gather");
  over_landed_rows([](int, int) {});
}

// Without sequence parallelism: kReducePieces row pieces, each all-reduced in place after its
// GEMM. With it: this rank computes the other ranks' blocks first, each sent to its owner (step i
// to rank r + i, receiving rank r - i's partial of my block into parts_), then its own block;
// local = own partial + the others' in step order.
void CudaOps::linear_reduced(bf16* y, const bf16* x, const bf16* w, int N, int in, int out) {
  QT_CHECK(N == N_ && (!sp_ || out == cfg_.hidden_size), "row-parallel GEMM of {} x {}", N, out);
  bf16* local = ahead_.local;
  ahead_ = {};
  reduced_ = y;
  const std::size_t i = in, o = out;
  auto gemm = [&](int r0, int rows) {
    linear_forward(y + r0 * o, x + r0 * i, w, rows, in, out, s_);
    tp_ready_.record(s_);
    tp_->wait_event(tp_ready_.get());
  };
  const int P = tp_->size(), r = tp_->rank();
  const std::size_t part = static_cast<std::size_t>(N / P) * o;  // elements of a rank's block
  if (!sp_) {
    const int piece = (N + kReducePieces - 1) / kReducePieces;
    for (int r0 = 0; r0 < N; r0 += piece) {
      const int rows = std::min(piece, N - r0);
      gemm(r0, rows);
      tp_->all_reduce_async(y + r0 * o, rows * o, DType::kBF16, ReduceOp::kSum);
    }
  } else {
    for (int step = 1; step < P; ++step) {
      const int to = (r + step) % P, from = (r + P - step) % P;
      gemm(to * (N / P), N / P);
      tp_->group_start();
      tp_->send_async(y + to * part, part, DType::kBF16, to);
      tp_->recv_async(parts_ + (step - 1) * part, part, DType::kBF16, from);
      tp_->group_end();
    }
    linear_forward(y + r * part, x + r * (N / P) * i, w, N / P, in, out, s_);
  }
  tp_done_.record(tp_->stream());
  QT_CHECK_CUDA(cudaStreamWaitEvent(s_, tp_done_.get(), 0));
  if (!sp_) return;
  add_bf16(local, y + r * part, parts_, part, s_);
  for (int step = 2; step < P; ++step) add_bf16(local, local, parts_ + (step - 1) * part, part, s_);
}

}  // namespace qt::cuda
