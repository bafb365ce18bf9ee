#include "cuda/collective_timer.h"

#include "cuda/check.h"

namespace qt::cuda {

namespace {
constexpr std::size_t kFoldAbove = 512;  // closed spans kept before folding finished ones
}  // namespace

CollectiveTimer::~CollectiveTimer() {
  // Destruction must not throw: events are released without checks.
  for (Span& sp : closed_) {
    cudaEventDestroy(sp.start);
    cudaEventDestroy(sp.stop);
  }
  if (current_.start != nullptr) cudaEventDestroy(current_.start);
  for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
}

CollectiveTimer::Span CollectiveTimer::open_span(cudaStream_t s) {
  Span sp;
  for (cudaEvent_t* e : {&sp.start, &sp.stop}) {
    if (free_events_.empty()) {
      QT_CHECK_CUDA(cudaEventCreate(e));
    } else {
      *e = free_events_.back();
      free_events_.pop_back();
    }
  }
  QT_CHECK_CUDA(cudaEventRecord(sp.start, s));
  return sp;
}

void CollectiveTimer::close_span(cudaStream_t s) {
  QT_CHECK_CUDA(cudaEventRecord(current_.stop, s));
  if (current_.has_call) {
    closed_.push_back(current_);
  } else {  // an empty group: nothing to count
    free_events_.push_back(current_.start);
    free_events_.push_back(current_.stop);
  }
  current_ = Span{};
  if (closed_.size() > kFoldAbove) fold_finished();
}

void CollectiveTimer::begin(cudaStream_t s, CollectiveKind k, double bytes) {
  if (depth_++ == 0) current_ = open_span(s);
  if (!current_.has_call) current_.kind = k;
  current_.has_call = true;
  current_.bytes += bytes;
}

void CollectiveTimer::end(cudaStream_t s) {
  if (depth_ > 0 && --depth_ == 0) close_span(s);
}

void CollectiveTimer::group_begin(cudaStream_t s) {
  if (depth_++ == 0) current_ = open_span(s);
}

void CollectiveTimer::group_end(cudaStream_t s) { end(s); }

void CollectiveTimer::fold(Span& sp) {
  float ms = 0;
  QT_CHECK_CUDA(cudaEventElapsedTime(&ms, sp.start, sp.stop));
  add_call(done_, sp.kind, sp.bytes, ranks_, 1e-3 * ms);
  free_events_.push_back(sp.start);
  free_events_.push_back(sp.stop);
}

void CollectiveTimer::fold_finished() {
  std::size_t kept = 0;
  for (Span& sp : closed_) {
    const cudaError_t q = cudaEventQuery(sp.stop);
    if (q == cudaSuccess) {
      fold(sp);
    } else {
      if (q != cudaErrorNotReady) QT_CHECK_CUDA(q);
      closed_[kept++] = sp;
    }
  }
  closed_.resize(kept);
}

CollectiveTimes CollectiveTimer::take() {
  for (Span& sp : closed_) {
    QT_CHECK_CUDA(cudaEventSynchronize(sp.stop));
    fold(sp);
  }
  closed_.clear();
  CollectiveTimes out = done_;
  done_ = {};
  return out;
}

}  // namespace qt::cuda
