// NcclComm with one rank: every collective on device buffers, host staging for scalars, and the
// timeout path at unit level (a stream blocked by a host function).
#include <chrono>
#include <string>
#include <thread>

#define QT_NCCL_RANKS 1
#include "nccl_cases.h"

namespace qt::cuda::nccl_test {
namespace {

void CUDART_CB sleep_two_seconds(void*) { std::this_thread::sleep_for(std::chrono::seconds(2)); }

// Runs last (gtest keeps definition order): the aborted communicator is its own.
TEST(NcclTimeout, BlockedStreamTimesOutWithAReport) {
  QT_REQUIRE_NCCL();
  NcclComm c(*g_env->world, "timeout-test", 0.5, OnTimeout::kThrow);
  EXPECT_EQ(c.timeout_s(), 0.5);
  test::GuardedBuffer<float> buf(1000);
  // The host function holds the communicator's stream for 2 s, so the all_reduce queued behind
  // it cannot finish within the 0.5 s timeout.
  QT_CHECK_CUDA(cudaLaunchHostFunc(c.stream(), sleep_two_seconds, nullptr));
  const auto t0 = std::chrono::steady_clock::now();
  try {
    c.all_reduce(buf.get(), 1000, DType::kF32, ReduceOp::kSum);
    FAIL() << "expected CommTimeout";
  } catch (const CommTimeout& e) {
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_GE(waited, 0.5);
    EXPECT_LT(waited, 10.0);
    const std::string msg = e.what();
    // "waited 0.x s": the wait stopped at the deadline, long before the stream was free (2 s).
    for (const char* part : {"all_reduce of 1000 f32", "'timeout-test'", "rank 0 of 1",
                             "timeout 0.5 s", "waited 0."})
      EXPECT_NE(msg.find(part), std::string::npos) << "'" << part << "' missing from: " << msg;
  }
  EXPECT_TRUE(c.aborted());
  EXPECT_THROW(c.barrier(), std::logic_error);
  EXPECT_EQ(cudaStreamSynchronize(c.stream()), cudaSuccess);  // the host function ends
}

}  // namespace
}  // namespace qt::cuda::nccl_test
