// NcclComm with two ranks on two GPUs (skips with a message unless each rank has its own GPU):
// every collective on device buffers, point-to-point pairs, and a timeout when one rank skips a
// collective. Run the timeout case under an outer `timeout` when trying a new NCCL version:
// it relies on ncclCommAbort stopping a kernel that waits for a peer.
#include <mpi.h>

#include <string>

#define QT_NCCL_RANKS 2
#include "nccl_cases.h"

namespace qt::cuda::nccl_test {
namespace {

// Rank 1 skips an all_reduce: rank 0 must report what it waited for and throw (kThrow), within
// the timeout; both ranks then carry on.
TEST(NcclTimeout, SkippedCollectiveTimesOutOnTheWaitingRank) {
  QT_REQUIRE_NCCL();
  NcclComm c(*g_env->world, "timeout-test", 2.0, OnTimeout::kThrow);
  c.barrier();
  test::GuardedBuffer<float> buf(4096);
  if (c.rank() == 0) {
    try {
      c.all_reduce(buf.get(), 4096, DType::kF32, ReduceOp::kSum);
      ADD_FAILURE() << "expected CommTimeout: rank 1 never joined the all_reduce";
    } catch (const CommTimeout& e) {
      const std::string msg = e.what();
      for (const char* part : {"all_reduce of 4096 f32", "'timeout-test'", "rank 0 of 2"})
        EXPECT_NE(msg.find(part), std::string::npos) << "'" << part << "' missing from: " << msg;
    }
    EXPECT_TRUE(c.aborted());
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace
}  // namespace qt::cuda::nccl_test
