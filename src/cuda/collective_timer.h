// Times a communicator's NCCL calls on its stream with CUDA events (NcclComm::take_times): a span
// opens before a call is enqueued and closes after, and its time is the stream's time between
// the two events, i.e. the call's kernels (waiting for the slowest peer included), which may
// overlap computation on other streams. Calls enqueued inside a group (group_begin .. group_end)
// form one span, timed from the group's start to its end, of the first call's kind and the
// calls' bytes together. Nothing here waits on the device except take().
#pragma once

#include <cuda_runtime_api.h>

#include <vector>

#include "qtrain/comm.h"

namespace qt::cuda {

class CollectiveTimer {
 public:
  explicit CollectiveTimer(int ranks) : ranks_(ranks) {}
  ~CollectiveTimer();
  CollectiveTimer(const CollectiveTimer&) = delete;
  CollectiveTimer& operator=(const CollectiveTimer&) = delete;

  // A call of `bytes` (comm.h's sizes) about to be enqueued on s; end() after it is enqueued.
  void begin(cudaStream_t s, CollectiveKind k, double bytes);
  void end(cudaStream_t s);
  void group_begin(cudaStream_t s);
  void group_end(cudaStream_t s);
  // The closed spans' times, summed by kind; waits for their events. Starts the count again.
  CollectiveTimes take();

 private:
  struct Span {
    cudaEvent_t start = nullptr, stop = nullptr;
    CollectiveKind kind = CollectiveKind::kAllReduce;
    double bytes = 0;
    bool has_call = false;  // a group's span: whether a call was enqueued in it
  };
  Span open_span(cudaStream_t s);
  void close_span(cudaStream_t s);
  // Folds the closed spans whose events have completed into done_ (bounds closed_ when take()
  // is rarely called).
  void fold_finished();
  void fold(Span& sp);

  int ranks_;
  int depth_ = 0;   // open spans: 1 inside a call or a group; nested calls add to it
  Span current_;
  std::vector<Span> closed_;             // recorded, not yet folded
  std::vector<cudaEvent_t> free_events_; // created, reusable
  CollectiveTimes done_{};
};

// Opens a span for one call and closes it when the scope ends (also on an exception).
class TimedCall {
 public:
  TimedCall(CollectiveTimer& t, cudaStream_t s, CollectiveKind k, double bytes) : t_(t), s_(s) {
    t_.begin(s, k, bytes);
  }
  ~TimedCall() { t_.end(s_); }
  TimedCall(const TimedCall&) = delete;
  TimedCall& operator=(const TimedCall&) = delete;

 private:
  CollectiveTimer& t_;
  cudaStream_t s_;
};

}  // namespace qt::cuda
