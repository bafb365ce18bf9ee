// Device selection and the device arena: alignment, mark/release, peak tracking, out of memory.
#include <cuda_runtime.h>  // typed cudaMalloc overload used by gpu_test.h
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "cuda/device.h"
#include "gpu_test.h"

namespace qt::cuda {
namespace {

bool aligned(const void* p, std::size_t a) { return reinterpret_cast<std::uintptr_t>(p) % a == 0; }

TEST(Device, SelectsLocalRankModuloCount) {
  QT_REQUIRE_GPU();
  int count = 0;
  QT_CHECK_CUDA(cudaGetDeviceCount(&count));
  for (int local : {0, 1, count, 2 * count + 1}) {
    const int d = select_device(local);
    EXPECT_EQ(d, local % count) << "local rank " << local;
    int current = -1;
    QT_CHECK_CUDA(cudaGetDevice(&current));
    EXPECT_EQ(current, d);
  }
  select_device(0);
  const DeviceInfo info = device_info();
  EXPECT_EQ(info.index, 0);
  EXPECT_FALSE(info.name.empty());
  EXPECT_GT(info.sm_count, 0);
  EXPECT_GT(info.total_bytes, std::size_t{0});
  std::printf("device 0: %s, %d SMs, cc %d.%d, %s, L2 %s\n", info.name.c_str(), info.sm_count,
              info.cc_major, info.cc_minor, format_bytes(info.total_bytes).c_str(),
              format_bytes(info.l2_bytes).c_str());
}

TEST(Device, MemoryQueryTracksAnAllocation) {
  QT_REQUIRE_GPU();
  const DeviceMemory before = device_memory();
  EXPECT_GT(before.total_bytes, std::size_t{0});
  EXPECT_LE(before.free_bytes, before.total_bytes);
  const std::size_t size = std::size_t{512} << 20;
  DeviceArena arena(size, "query");
  const DeviceMemory after = device_memory();
  EXPECT_EQ(after.total_bytes, before.total_bytes);
  // The free figure drops by at least the arena (other processes may allocate too, so no equality).
  EXPECT_LE(after.free_bytes + size, before.free_bytes + (std::size_t{64} << 20));
}

TEST(DeviceArena, BlocksAreAlignedDisjointAndCounted) {
  QT_REQUIRE_GPU();
  DeviceArena arena(1 << 20, "align");
  EXPECT_EQ(arena.capacity(), std::size_t{1} << 20);
  const std::vector<std::size_t> sizes = {1, 3, 255, 256, 257, 1000, 0, 4096, 7};
  std::vector<char*> ptrs;
  std::size_t expect_used = 0;
  for (std::size_t s : sizes) {
    char* p = static_cast<char*>(arena.allocate(s));
    ASSERT_NE(p, nullptr);
    EXPECT_TRUE(aligned(p, DeviceArena::kAlignment)) << "block of " << s << " bytes";
    EXPECT_TRUE(arena.owns(p));
    ptrs.push_back(p);
    expect_used += (s + 255) / 256 * 256;
    EXPECT_EQ(arena.used(), expect_used);
  }
  // Disjoint: each block ends at or before the next one starts.
  for (std::size_t i = 0; i + 1 < ptrs.size(); ++i) EXPECT_GE(ptrs[i + 1], ptrs[i] + sizes[i]);
  // Every byte of every block is writable, and writing them leaves the neighbours alone.
  for (std::size_t i = 0; i < ptrs.size(); ++i)
    QT_CHECK_CUDA(cudaMemset(ptrs[i], static_cast<int>(i + 1), sizes[i]));
  for (std::size_t i = 0; i < ptrs.size(); ++i) {
    if (sizes[i] == 0) continue;
    std::vector<unsigned char> h(sizes[i]);
    QT_CHECK_CUDA(cudaMemcpy(h.data(), ptrs[i], sizes[i], cudaMemcpyDeviceToHost));
    for (unsigned char c : h) ASSERT_EQ(c, static_cast<unsigned char>(i + 1)) << "block " << i;
  }
  // Typed allocation is aligned too.
  double* d = arena.allocate<double>(3);
  EXPECT_TRUE(aligned(d, 256));
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

TEST(DeviceArena, MarkReleaseAndPeak) {
  QT_REQUIRE_GPU();
  DeviceArena arena(64 * 1024, "scratch");
  void* persistent = arena.allocate(1000);  // 1024 bytes
  const std::size_t m = arena.mark();
  EXPECT_EQ(m, 1024u);
  void* a = arena.allocate(4096);
  arena.allocate(10000);  // 10240 bytes
  EXPECT_EQ(arena.used(), 1024u + 4096u + 10240u);
  EXPECT_EQ(arena.peak(), arena.used());
  arena.release(m);
  EXPECT_EQ(arena.used(), 1024u);
  EXPECT_EQ(arena.peak(), 1024u + 4096u + 10240u);  // the peak survives the release
  EXPECT_EQ(arena.allocate(16), a);                   // the released space is handed out again
  EXPECT_NE(persistent, a);
  {
    DeviceArena::Scope scope(arena);
    arena.allocate(30000);
    EXPECT_EQ(arena.used(), 1024u + 256u + 30208u);
  }
  EXPECT_EQ(arena.used(), 1024u + 256u);
  EXPECT_EQ(arena.peak(), 1024u + 256u + 30208u);
  arena.reset_peak();
  EXPECT_EQ(arena.peak(), arena.used());
  // A stale mark (beyond the current offset) is refused.
  EXPECT_THROW(arena.release(arena.used() + 256), std::logic_error);
  arena.release(0);
  EXPECT_EQ(arena.used(), 0u);
}

TEST(DeviceArena, OutOfMemoryIsAClearErrorAndLeavesTheArenaUsable) {
  QT_REQUIRE_GPU();
  DeviceArena arena(8192, "tiny");
  arena.allocate(5000);
  try {
    arena.allocate(4000);
    FAIL() << "expected OutOfMemory";
  } catch (const OutOfMemory& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'tiny'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("4000 bytes"), std::string::npos) << msg;
    EXPECT_NE(msg.find("in use"), std::string::npos) << msg;
  }
  EXPECT_EQ(arena.used(), 5120u);
  EXPECT_NE(arena.allocate(3072), nullptr);  // exactly fills the arena
  EXPECT_EQ(arena.used(), 8192u);
  EXPECT_THROW(arena.allocate(1), OutOfMemory);
  EXPECT_THROW(arena.allocate(static_cast<std::size_t>(-1)), OutOfMemory);  // no wrap-around
  EXPECT_THROW(arena.allocate<double>(static_cast<std::size_t>(-1) / 4), OutOfMemory);
}

TEST(DeviceArena, ImpossibleCapacityThrowsAndClearsTheCudaError) {
  QT_REQUIRE_GPU();
  const DeviceMemory mem = device_memory();
  try {
    DeviceArena arena(mem.total_bytes * 4, "huge");
    FAIL() << "expected OutOfMemory";
  } catch (const OutOfMemory& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'huge'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("cudaMalloc"), std::string::npos) << msg;
  }
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  DeviceArena ok(1 << 20, "after");  // the device still works
  EXPECT_EQ(ok.used(), 0u);
}

TEST(StreamEvent, TimesWorkOnAStream) {
  QT_REQUIRE_GPU();
  DeviceArena arena(std::size_t{64} << 20, "copy");
  void* a = arena.allocate(std::size_t{32} << 20);
  void* b = arena.allocate(std::size_t{32} << 20);
  Stream s;
  Event start(true), stop(true);
  start.record(s.get());
  QT_CHECK_CUDA(cudaMemcpyAsync(b, a, std::size_t{32} << 20, cudaMemcpyDeviceToDevice, s.get()));
  stop.record(s.get());
  stop.synchronize();
  const float ms = stop.elapsed_ms_since(start);
  EXPECT_GT(ms, 0.f);
  EXPECT_LT(ms, 1000.f);
}

}  // namespace
}  // namespace qt::cuda
