// NCCL communicator cases shared by test_nccl_np1.cpp and test_nccl_np2.cpp (include it from
// exactly one .cpp per executable, after defining QT_NCCL_RANKS). Every case works for any number
// of ranks: each rank builds its inputs from (seed, rank, element) as small integers, so every
// rank can compute the exact expected result of every collective on the host.
#pragma once

#include <cuda_runtime.h>  // typed cudaMalloc overload used by gpu_test.h
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "cuda/device.h"
#include "cuda/nccl_comm.h"
#include "gpu_test.h"
#include "qtrain/mesh.h"
#include "support/random.h"

#ifndef QT_NCCL_RANKS
#error "define QT_NCCL_RANKS before including nccl_cases.h"
#endif

namespace qt::cuda::nccl_test {

using bf16 = __nv_bfloat16;

// The communicator under test: made once per process (NCCL set-up is slow) on the GPU of the
// node-local rank, destroyed before MPI_Finalize.
struct Env : ::testing::Environment {
  std::string skip_reason;
  std::shared_ptr<MpiComm> world;
  std::unique_ptr<Mesh> mesh;
  std::unique_ptr<NcclComm> comm;
  std::uint64_t seed = 0;

  void SetUp() override {
    world = std::make_shared<MpiComm>(MPI_COMM_WORLD, "world", false);
    if (world->size() != QT_NCCL_RANKS) {
      skip_reason = "needs " + std::to_string(QT_NCCL_RANKS) + " ranks, got " +
                    std::to_string(world->size());
      return;
    }
    mesh = std::make_unique<Mesh>(MeshShape{world->size(), 1, 1, 1}, world);
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      cudaGetLastError();
      count = 0;
    }
    // One GPU per rank of a node; decided together so that every rank skips or none does.
    int ok = count >= mesh->local_size() ? 1 : 0, all_ok = 0;
    MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (all_ok == 0) {
      skip_reason = "needs one GPU per rank: " + std::to_string(mesh->local_size()) +
                    " ranks on this node see " + std::to_string(count) + " GPU(s)";
      return;
    }
    select_device(mesh->local_rank());
    comm = std::make_unique<NcclComm>(*world, "test", 60.0);
    seed = qt::test::test_seed();
    MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  }
  void TearDown() override {
    comm.reset();
    mesh.reset();
    world.reset();
  }
};

inline Env* const g_env = static_cast<Env*>(::testing::AddGlobalTestEnvironment(new Env));

#define QT_REQUIRE_NCCL()                                                    \
  do {                                                                       \
    if (!::qt::cuda::nccl_test::g_env->comm)                                 \
      GTEST_SKIP() << ::qt::cuda::nccl_test::g_env->skip_reason;             \
  } while (0)

inline NcclComm& comm() { return *g_env->comm; }

// ---- values --------------------------------------------------------------------------------------

template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::kF32; }
template <> constexpr DType dtype_of<double>() { return DType::kF64; }
template <> constexpr DType dtype_of<bf16>() { return DType::kBF16; }
template <> constexpr DType dtype_of<std::int32_t>() { return DType::kI32; }
template <> constexpr DType dtype_of<std::int64_t>() { return DType::kI64; }
template <> constexpr DType dtype_of<std::uint64_t>() { return DType::kU64; }

template <typename T>
T from_int(long v) {
  if constexpr (std::is_same_v<T, bf16>) {
    const float f = static_cast<float>(v);  // small integers are exact in bf16
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    __nv_bfloat16_raw r;
    r.x = static_cast<unsigned short>(u >> 16);
    return T(r);
  } else {
    return static_cast<T>(v);
  }
}

template <typename T>
double to_double(T v) {
  if constexpr (std::is_same_v<T, bf16>) {
    const std::uint32_t u = static_cast<std::uint32_t>(static_cast<__nv_bfloat16_raw>(v).x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  } else {
    return static_cast<double>(v);
  }
}

inline std::uint64_t mix(std::uint64_t x) {  // splitmix64 finaliser
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Element i of rank r's input for case `salt`: an integer in [-8, 8] ([0, 16] for unsigned).
template <typename T>
long value_of(int r, int salt, std::size_t i) {
  const std::uint64_t h = mix(g_env->seed ^ mix(static_cast<std::uint64_t>(r) * 1000003u + salt) ^
                              mix(i + 0x1234567ull));
  const long v = static_cast<long>(h % 17);
  return std::is_unsigned_v<T> ? v : v - 8;
}

template <typename T>
std::vector<T> inputs(int r, int salt, std::size_t n) {
  std::vector<T> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = from_int<T>(value_of<T>(r, salt, i));
  return v;
}

inline long reduce(ReduceOp op, long a, long b) {
  return op == ReduceOp::kSum ? a + b : op == ReduceOp::kMax ? std::max(a, b) : std::min(a, b);
}

// Exact comparison (all values are small integers); reports the first mismatch.
template <typename T>
::testing::AssertionResult equal(const std::vector<T>& got, const std::vector<long>& want) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "size mismatch";
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (to_double(got[i]) != static_cast<double>(want[i]))
      return ::testing::AssertionFailure() << "element " << i << ": got " << to_double(got[i])
                                           << ", want " << want[i];
  }
  return ::testing::AssertionSuccess();
}

// ---- cases ---------------------------------------------------------------------------------------

template <typename T>
void check_all_reduce(ReduceOp op, int salt) {
  const std::size_t n = 1237;
  const int size = comm().size();
  test::GuardedBuffer<T> buf(inputs<T>(comm().rank(), salt, n));
  comm().all_reduce(buf.get(), n, dtype_of<T>(), op);
  std::vector<long> want(n);
  for (std::size_t i = 0; i < n; ++i) {
    long acc = value_of<T>(0, salt, i);
    for (int r = 1; r < size; ++r) acc = reduce(op, acc, value_of<T>(r, salt, i));
    want[i] = acc;
  }
  EXPECT_TRUE(equal(buf.download(), want)) << dtype_name(dtype_of<T>()) << " op "
                                           << static_cast<int>(op);
  EXPECT_TRUE(buf.guard_intact());
}

TEST(Nccl, AllReduceEveryDtypeAndOp) {
  QT_REQUIRE_NCCL();
  int salt = 0;
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kMin}) {
    check_all_reduce<float>(op, ++salt);
    check_all_reduce<double>(op, ++salt);
    check_all_reduce<bf16>(op, ++salt);
    check_all_reduce<std::int32_t>(op, ++salt);
    check_all_reduce<std::int64_t>(op, ++salt);
    check_all_reduce<std::uint64_t>(op, ++salt);
  }
}

TEST(Nccl, AllReduceAsyncThenSynchronize) {
  QT_REQUIRE_NCCL();
  const std::size_t n = std::size_t{1} << 22;  // 16 MiB of fp32
  test::GuardedBuffer<float> buf(inputs<float>(comm().rank(), 100, n));
  comm().all_reduce_async(buf.get(), n, DType::kF32, ReduceOp::kSum);
  comm().synchronize();
  std::vector<long> want(n, 0);
  for (int r = 0; r < comm().size(); ++r)
    for (std::size_t i = 0; i < n; ++i) want[i] += value_of<float>(r, 100, i);
  EXPECT_TRUE(equal(buf.download(), want));
  EXPECT_TRUE(buf.guard_intact());
}

template <typename T>
void check_reduce_scatter(int salt) {
  const std::size_t count = 513;
  const int size = comm().size(), rank = comm().rank();
  test::GuardedBuffer<T> send(inputs<T>(rank, salt, count * size));
  test::GuardedBuffer<T> recv(count);
  comm().reduce_scatter(send.get(), recv.get(), count, dtype_of<T>(), ReduceOp::kSum);
  std::vector<long> want(count, 0);
  for (int r = 0; r < size; ++r)
    for (std::size_t i = 0; i < count; ++i) want[i] += value_of<T>(r, salt, rank * count + i);
  EXPECT_TRUE(equal(recv.download(), want)) << dtype_name(dtype_of<T>());
  EXPECT_TRUE(recv.guard_intact());
}

TEST(Nccl, ReduceScatter) {
  QT_REQUIRE_NCCL();
  check_reduce_scatter<float>(200);
  check_reduce_scatter<bf16>(201);
  check_reduce_scatter<std::int64_t>(202);
}

template <typename T>
void check_all_gather(int salt) {
  const std::size_t count = 777;
  const int size = comm().size();
  test::GuardedBuffer<T> send(inputs<T>(comm().rank(), salt, count));
  test::GuardedBuffer<T> recv(count * size);
  comm().all_gather(send.get(), recv.get(), count, dtype_of<T>());
  std::vector<long> want(count * size);
  for (int r = 0; r < size; ++r)
    for (std::size_t i = 0; i < count; ++i) want[r * count + i] = value_of<T>(r, salt, i);
  EXPECT_TRUE(equal(recv.download(), want)) << dtype_name(dtype_of<T>());
  EXPECT_TRUE(recv.guard_intact());
}

TEST(Nccl, AllGather) {
  QT_REQUIRE_NCCL();
  check_all_gather<float>(300);
  check_all_gather<bf16>(301);
  check_all_gather<std::uint64_t>(302);
}

TEST(Nccl, BroadcastFromEveryRoot) {
  QT_REQUIRE_NCCL();
  const std::size_t n = 4099;
  for (int root = 0; root < comm().size(); ++root) {
    test::GuardedBuffer<std::int32_t> buf(inputs<std::int32_t>(comm().rank(), 400 + root, n));
    comm().broadcast(buf.get(), n, DType::kI32, root);
    std::vector<long> want(n);
    for (std::size_t i = 0; i < n; ++i) want[i] = value_of<std::int32_t>(root, 400 + root, i);
    EXPECT_TRUE(equal(buf.download(), want)) << "root " << root;
    EXPECT_TRUE(buf.guard_intact());
  }
}

// Rank s sends (s + 2d + salt) % 4 elements to rank d (zero blocks included); displacements leave
// a one-element gap after every block, which must stay untouched.
template <typename T>
void check_all_to_all_v(int salt) {
  const int size = comm().size(), rank = comm().rank();
  auto count = [&](int s, int d) { return static_cast<std::size_t>((s + 2 * d + salt) % 4); };
  std::vector<std::size_t> sc(size), sd(size), rc(size), rd(size);
  std::size_t s_total = 0, r_total = 0;
  for (int p = 0; p < size; ++p) {
    sc[p] = count(rank, p);
    sd[p] = s_total;
    s_total += sc[p] + 1;
    rc[p] = count(p, rank);
    rd[p] = r_total;
    r_total += rc[p] + 1;
  }
  // Element j of the block from s to d is 16 * (s * size + d) + j: unique, exact in bf16 for
  // the sizes used here.
  std::vector<T> send(s_total, from_int<T>(-1));
  for (int p = 0; p < size; ++p)
    for (std::size_t j = 0; j < sc[p]; ++j) send[sd[p] + j] = from_int<T>(16 * (rank * size + p) + j);
  test::GuardedBuffer<T> d_send(send);
  test::GuardedBuffer<T> d_recv(std::vector<T>(r_total, from_int<T>(-3)));
  comm().all_to_all_v(d_send.get(), sc, sd, d_recv.get(), rc, rd, dtype_of<T>());
  std::vector<long> want(r_total, -3);
  for (int p = 0; p < size; ++p)
    for (std::size_t j = 0; j < rc[p]; ++j) want[rd[p] + j] = 16 * (p * size + rank) + j;
  EXPECT_TRUE(equal(d_recv.download(), want)) << dtype_name(dtype_of<T>()) << " salt " << salt;
  EXPECT_TRUE(d_recv.guard_intact());
}

TEST(Nccl, AllToAllVUnevenBlocks) {
  QT_REQUIRE_NCCL();
  for (int salt = 0; salt < 4; ++salt) {
    check_all_to_all_v<float>(salt);
    check_all_to_all_v<bf16>(salt);
    check_all_to_all_v<std::int64_t>(salt);
  }
}

// ---- all-to-all with counts in device memory (expert dispatch) -----------------------------------

constexpr std::size_t kA2aCapacity = 37;  // elements per peer block

// Valid elements in rank s's block for rank d in case `salt`: none, the full capacity or some in
// between, by (s, d, salt), so that salts 0..2 give every pair of ranks each kind (with one rank,
// its own block).
inline std::int64_t a2a_count(int s, int d, int salt) {
  switch ((s * comm().size() + d + salt) % 3) {
    case 0: return 0;
    case 1: return static_cast<std::int64_t>(kA2aCapacity);
    default: return 1 + (7 * s + 3 * d + salt) % static_cast<int>(kA2aCapacity - 1);
  }
}

// This rank's send blocks: element j of the block for rank p is the seeded input element
// p * capacity + j while j < a2a_count(rank, p); 99 (outside the inputs' [-8, 16]) after it.
template <typename T>
std::vector<T> a2a_send_blocks(int salt) {
  const int size = comm().size(), rank = comm().rank();
  std::vector<T> v(size * kA2aCapacity, from_int<T>(99));
  for (int p = 0; p < size; ++p)
    for (std::int64_t j = 0; j < a2a_count(rank, p, salt); ++j)
      v[p * kA2aCapacity + j] = from_int<T>(value_of<T>(rank, salt, p * kA2aCapacity + j));
  return v;
}

inline std::vector<std::int64_t> a2a_send_counts(int salt) {
  std::vector<std::int64_t> c(comm().size());
  for (int p = 0; p < comm().size(); ++p) c[p] = a2a_count(comm().rank(), p, salt);
  return c;
}

// Every received count, every valid received element and the guard bytes after both buffers.
template <typename T>
::testing::AssertionResult a2a_received(const test::GuardedBuffer<T>& recv,
                                        const test::GuardedBuffer<std::int64_t>& recv_counts,
                                        int salt) {
  const int size = comm().size(), rank = comm().rank();
  const std::vector<std::int64_t> counts = recv_counts.download();
  const std::vector<T> got = recv.download();
  for (int p = 0; p < size; ++p) {
    const std::int64_t want = a2a_count(p, rank, salt);
    if (counts[p] != want)
      return ::testing::AssertionFailure() << "count from rank " << p << ": got " << counts[p]
                                           << ", want " << want;
    for (std::int64_t j = 0; j < want; ++j) {
      const long v = value_of<T>(p, salt, rank * kA2aCapacity + j);
      if (to_double(got[p * kA2aCapacity + j]) != static_cast<double>(v))
        return ::testing::AssertionFailure() << "block from rank " << p << ", element " << j
                                             << ": got " << to_double(got[p * kA2aCapacity + j])
                                             << ", want " << v;
    }
  }
  if (!recv.guard_intact() || !recv_counts.guard_intact())
    return ::testing::AssertionFailure() << "guard bytes after recv or its counts overwritten";
  return ::testing::AssertionSuccess();
}

template <typename T>
void check_all_to_all_device(int salt) {
  const int size = comm().size();
  test::GuardedBuffer<T> send(a2a_send_blocks<T>(salt));
  test::GuardedBuffer<T> recv(std::vector<T>(size * kA2aCapacity, from_int<T>(77)));
  test::GuardedBuffer<std::int64_t> send_counts(a2a_send_counts(salt));
  test::GuardedBuffer<std::int64_t> recv_counts(std::vector<std::int64_t>(size, -7));
  comm().all_to_all_device_async(send.get(), send_counts.get(), recv.get(), recv_counts.get(),
                                 kA2aCapacity, dtype_of<T>());
  comm().synchronize();
  EXPECT_TRUE(a2a_received(recv, recv_counts, salt)) << dtype_name(dtype_of<T>()) << " salt "
                                                     << salt;
}

TEST(Nccl, AllToAllDeviceCounts) {
  QT_REQUIRE_NCCL();
  for (int salt = 0; salt < 3; ++salt) {
    check_all_to_all_device<float>(salt);
    check_all_to_all_device<bf16>(salt);
    check_all_to_all_device<std::int64_t>(salt);
  }
  // Capacity 0: only the counts travel; the data buffers may be null.
  const int size = comm().size();
  test::GuardedBuffer<std::int64_t> zeros(std::vector<std::int64_t>(size, 0));
  test::GuardedBuffer<std::int64_t> got(std::vector<std::int64_t>(size, -7));
  comm().all_to_all_device_async(nullptr, zeros.get(), nullptr, got.get(), 0, DType::kF32);
  comm().synchronize();
  EXPECT_EQ(got.download(), std::vector<std::int64_t>(size, 0));
  // The counts must be device memory; recv must not overlap send.
  std::vector<std::int64_t> host_counts(size, 0);
  test::GuardedBuffer<float> buf(size * kA2aCapacity);
  EXPECT_THROW(comm().all_to_all_device_async(buf.get(), host_counts.data(), buf.get(), got.get(),
                                              kA2aCapacity, DType::kF32),
               std::invalid_argument);
  EXPECT_THROW(comm().all_to_all_device_async(buf.get(), zeros.get(), buf.get(), nullptr,
                                              kA2aCapacity, DType::kF32),
               std::invalid_argument);
  EXPECT_THROW(comm().all_to_all_device_async(buf.get(), zeros.get(), buf.get(), got.get(),
                                              kA2aCapacity, DType::kF32),
               std::invalid_argument);  // in place
}

// Holds a stream in a host function until the host opens the gate (or 30 s pass, gave_up): work
// queued behind it cannot have run before the gate opens.
struct StreamGate {
  std::atomic<bool> open{false};
  std::atomic<bool> gave_up{false};
  static void CUDART_CB hold(void* self) {
    auto* g = static_cast<StreamGate*>(self);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!g->open.load()) {
      if (std::chrono::steady_clock::now() > deadline) {
        g->gave_up = true;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
};

// The router's counts and tokens are written on the communicator's stream behind a held gate, and
// the all-to-all is queued after them: it must return while the stream is still held (no host
// wait), and deliver what the stream wrote (stream order), not what the buffers held before.
TEST(Nccl, AllToAllDeviceCountsQueueWithoutWaiting) {
  QT_REQUIRE_NCCL();
  using T = float;
  const int salt = 1, size = comm().size();
  check_all_to_all_device<T>(salt);  // connections to the peers are set up outside the gate
  const std::vector<T> blocks = a2a_send_blocks<T>(salt);
  const std::vector<std::int64_t> counts = a2a_send_counts(salt);
  test::GuardedBuffer<T> routed(blocks), send(std::vector<T>(blocks.size(), from_int<T>(55)));
  test::GuardedBuffer<std::int64_t> counted(counts);
  test::GuardedBuffer<std::int64_t> send_counts(std::vector<std::int64_t>(size, -9));
  test::GuardedBuffer<T> recv(std::vector<T>(size * kA2aCapacity, from_int<T>(77)));
  test::GuardedBuffer<std::int64_t> recv_counts(std::vector<std::int64_t>(size, -7));
  StreamGate gate;
  const cudaStream_t s = comm().stream();
  QT_CHECK_CUDA(cudaLaunchHostFunc(s, StreamGate::hold, &gate));
  QT_CHECK_CUDA(cudaMemcpyAsync(send_counts.get(), counted.get(), send_counts.bytes(),
                                cudaMemcpyDeviceToDevice, s));
  QT_CHECK_CUDA(
      cudaMemcpyAsync(send.get(), routed.get(), send.bytes(), cudaMemcpyDeviceToDevice, s));
  comm().all_to_all_device_async(send.get(), send_counts.get(), recv.get(), recv_counts.get(),
                                 kA2aCapacity, DType::kF32);
  const cudaError_t held = cudaStreamQuery(s);
  gate.open = true;
  comm().synchronize();
  EXPECT_FALSE(gate.gave_up.load())
      << "all_to_all_device_async waited on the host for its held stream (the gate gave up)";
  EXPECT_EQ(held, cudaErrorNotReady);
  EXPECT_TRUE(a2a_received(recv, recv_counts, salt));
}

TEST(Nccl, SendRecvPairs) {
  QT_REQUIRE_NCCL();
  const int size = comm().size(), rank = comm().rank();
  test::GuardedBuffer<float> buf(16);
  EXPECT_THROW(comm().send(buf.get(), 16, DType::kF32, size, 0), std::invalid_argument);
  EXPECT_THROW(comm().recv(buf.get(), 16, DType::kF32, -1, 0), std::invalid_argument);
  comm().send(buf.get(), 0, DType::kF32, rank, 0);  // empty messages return at once
  comm().recv(buf.get(), 0, DType::kF32, rank, 0);
  const int partner = rank ^ 1;
  if (size < 2 || partner >= size) return;  // with one rank there is no one to talk to
  // Rendezvous semantics: the even rank sends first, the odd one receives first.
  const std::size_t n = 100003;
  test::GuardedBuffer<float> mine(inputs<float>(rank, 500, n)), theirs(n);
  if (rank % 2 == 0) {
    comm().send(mine.get(), n, DType::kF32, partner, 0);
    comm().recv(theirs.get(), n, DType::kF32, partner, 0);
  } else {
    comm().recv(theirs.get(), n, DType::kF32, partner, 0);
    comm().send(mine.get(), n, DType::kF32, partner, 0);
  }
  std::vector<long> want(n);
  for (std::size_t i = 0; i < n; ++i) want[i] = value_of<float>(partner, 500, i);
  EXPECT_TRUE(equal(theirs.download(), want));
  EXPECT_TRUE(theirs.guard_intact());
}

// A pipeline stage's exchange: in one group every rank sends to both neighbours and receives from
// both at once, which blocking rendezvous sends would deadlock.
TEST(Nccl, BatchedSendRecvBothWaysInOneGroup) {
  QT_REQUIRE_NCCL();
  const int size = comm().size(), rank = comm().rank();
  const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
  const std::size_t n = 65537;
  test::GuardedBuffer<float> mine(inputs<float>(rank, 700, n)), from_prev(n), from_next(n);
  comm().group_start();
  comm().send_async(mine.get(), n, DType::kF32, next);
  comm().send_async(mine.get(), n, DType::kF32, prev);
  comm().recv_async(from_prev.get(), n, DType::kF32, prev);
  comm().recv_async(from_next.get(), n, DType::kF32, next);
  comm().group_end();
  comm().synchronize();
  std::vector<long> want_prev(n), want_next(n);
  for (std::size_t i = 0; i < n; ++i) {
    want_prev[i] = value_of<float>(prev, 700, i);
    want_next[i] = value_of<float>(next, 700, i);
  }
  EXPECT_TRUE(equal(from_prev.download(), want_prev));
  EXPECT_TRUE(equal(from_next.download(), want_next));
  EXPECT_TRUE(from_prev.guard_intact() && from_next.guard_intact());
  EXPECT_THROW(comm().send_async(mine.get(), n, DType::kF32, size), std::invalid_argument);
}

// The mesh owns one device communicator per dimension: asked twice, the same one, and usable.
TEST(Nccl, MeshOwnsItsDeviceCommunicators) {
  QT_REQUIRE_NCCL();
  Mesh& mesh = *g_env->mesh;
  NcclComm& a = nccl(mesh, MeshDim::kDp);
  EXPECT_EQ(&a, &nccl(mesh, MeshDim::kDp));
  EXPECT_EQ(a.size(), mesh.dp().size());
  EXPECT_EQ(a.rank(), mesh.dp().rank());
  EXPECT_EQ(a.sum(1.0), static_cast<double>(a.size()));
}

TEST(Nccl, HostBuffersAreStagedForScalars) {
  QT_REQUIRE_NCCL();
  const int size = comm().size(), rank = comm().rank();
  EXPECT_EQ(comm().sum(static_cast<double>(rank) + 1.5), size * (size + 2) / 2.0);
  EXPECT_EQ(comm().max(static_cast<double>(rank)), size - 1.0);
  EXPECT_EQ(comm().sum(static_cast<std::int64_t>(rank) << 40), (std::int64_t{size} * (size - 1) / 2) << 40);
  std::vector<std::int32_t> mine = {rank, 10 * rank}, all(2 * size);
  comm().all_gather(mine.data(), all.data(), 2, DType::kI32);
  for (int r = 0; r < size; ++r) {
    EXPECT_EQ(all[2 * r], r);
    EXPECT_EQ(all[2 * r + 1], 10 * r);
  }
  std::int64_t v = rank == 0 ? 4242 : -1;
  comm().broadcast(&v, 1, DType::kI64, 0);
  EXPECT_EQ(v, 4242);
  std::vector<float> big(NcclComm::kHostStagingBytes / 4 + 1, 1.f);
  EXPECT_THROW(comm().all_reduce(big.data(), big.size(), DType::kF32, ReduceOp::kSum),
               std::invalid_argument);
}

// Each call is timed on the stream by kind with NCCL-tests sizes; a group counts once, of its
// calls' bytes together; a take starts the count again.
TEST(Nccl, TakeTimesCountsCallsAndGroups) {
  QT_REQUIRE_NCCL();
  const int size = comm().size(), rank = comm().rank();
  const std::size_t n = std::size_t{1} << 20;
  test::GuardedBuffer<float> buf(inputs<float>(rank, 800, n * size)), out(n * size);
  comm().take_times();  // whatever earlier tests left
  comm().all_reduce_async(buf.get(), n, DType::kF32, ReduceOp::kSum);
  comm().all_gather_async(buf.get(), out.get(), n, DType::kF32);
  comm().group_start();
  comm().send_async(buf.get(), n, DType::kF32, (rank + 1) % size);
  comm().recv_async(out.get(), n, DType::kF32, (rank + size - 1) % size);
  comm().group_end();
  const CollectiveTimes t = comm().take_times();  // waits for them
  const auto at = [&](CollectiveKind k) { return t[static_cast<std::size_t>(k)]; };
  const double ring = (size - 1.0) / size;
  EXPECT_EQ(at(CollectiveKind::kAllReduce).calls, 1);
  EXPECT_EQ(at(CollectiveKind::kAllReduce).bytes, 4.0 * n);
  EXPECT_DOUBLE_EQ(at(CollectiveKind::kAllReduce).bus_bytes, 8.0 * n * ring);
  EXPECT_GT(at(CollectiveKind::kAllReduce).seconds, 0);
  EXPECT_LT(at(CollectiveKind::kAllReduce).seconds, 10);
  EXPECT_EQ(at(CollectiveKind::kAllGather).bytes, 4.0 * n * size);  // the whole output
  EXPECT_EQ(at(CollectiveKind::kPointToPoint).calls, 1);            // one group
  EXPECT_EQ(at(CollectiveKind::kPointToPoint).bytes, 8.0 * n);      // its send and recv
  EXPECT_GT(at(CollectiveKind::kPointToPoint).seconds, 0);
  EXPECT_EQ(comm().take_times()[0].calls, 0);
}

TEST(Nccl, BarrierAndBadArguments) {
  QT_REQUIRE_NCCL();
  comm().barrier();
  comm().barrier();
  test::GuardedBuffer<float> buf(8);
  EXPECT_THROW(comm().broadcast(buf.get(), 8, DType::kF32, comm().size()), std::invalid_argument);
  const std::vector<std::size_t> wrong(comm().size() + 1, 0);
  EXPECT_THROW(comm().all_to_all_v(buf.get(), wrong, wrong, buf.get(), wrong, wrong, DType::kF32),
               std::invalid_argument);
  std::vector<float> host(8);
  EXPECT_THROW(comm().all_reduce_async(host.data(), 8, DType::kF32, ReduceOp::kSum),
               std::invalid_argument);
  EXPECT_EQ(comm().name(), "test");
  const char* nvls = std::getenv("NCCL_NVLS_ENABLE");
  ASSERT_NE(nvls, nullptr);
  EXPECT_STREQ(nvls, "0") << "NVLink multicast must stay off";
  comm().barrier();
}

}  // namespace qt::cuda::nccl_test
