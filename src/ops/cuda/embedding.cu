// Embedding forward (row gather) and deterministic backward (sort by id, then a fixed-order
// segmented sum); see embedding.cuh.
#include <cstdint>
#include <string>

#include <cub/device/device_radix_sort.cuh>

#include "ops/cuda/common.cuh"
#include "ops/cuda/embedding.cuh"

namespace qt::cuda {

static constexpr int kThreads = 256;
static constexpr int kBwdThreads = 128;  // column vectors per block in the backward

// One thread per 8 columns of one token: t = n * (C / 8) + v. wte holds table rows [first,
// first + count); a token whose id is outside them gets a zero row.
static __global__ void embedding_forward_kernel(bf16* __restrict__ x,
                                                const std::int32_t* __restrict__ ids,
                                                const bf16* __restrict__ wte, int N, int C,
                                                std::int64_t first, std::int64_t count) {
  const int vecs = C / 8;
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= static_cast<std::int64_t>(N) * vecs) return;
  const std::int64_t n = t / vecs;
  const int v = static_cast<int>(t - n * vecs);
  const std::int64_t r = ids[n] - first;
  uint4 row = make_uint4(0, 0, 0, 0);
  if (r >= 0 && r < count)
    row = __ldg(reinterpret_cast<const uint4*>(wte + static_cast<std::size_t>(r) * C) + v);
  reinterpret_cast<uint4*>(x + static_cast<std::size_t>(n) * C)[v] = row;
}

// keys[n] = ids[n] (as unsigned), positions[n] = n: the input of the sort.
static __global__ void embedding_sort_input_kernel(std::uint32_t* keys, std::int32_t* positions,
                                                   const std::int32_t* ids, int N) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  keys[n] = static_cast<std::uint32_t>(ids[n]);
  positions[n] = n;
}

// Block (k, y): if sorted entry k starts a run of equal ids, adds the run's rows of dx (in
// ascending position) to dwte[id], for column vectors y * kBwdThreads + threadIdx.x.
// kRange: only the elements of the flat table range [lo, hi) exist, element e at out[e - lo]
// (scalar stores: lo need not be a multiple of a vector).
template <bool kRange>
static __global__ void embedding_backward_kernel(float* out, const bf16* __restrict__ dx,
                                                 const std::uint32_t* __restrict__ keys,
                                                 const std::int32_t* __restrict__ positions, int N,
                                                 int C, std::size_t lo, std::size_t hi) {
  const int k = blockIdx.x;
  const std::uint32_t id = keys[k];
  if (k > 0 && keys[k - 1] == id) return;  // not the start of a run: the run's owner adds it
  const int v = blockIdx.y * kBwdThreads + threadIdx.x;
  if (v * 8 >= C) return;
  const std::size_t e0 = static_cast<std::size_t>(id) * C + v * 8;  // flat table index
  if (kRange && (e0 + 8 <= lo || e0 >= hi)) return;
  float acc[8];
  if (kRange) {
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = e0 + i >= lo && e0 + i < hi ? out[e0 + i - lo] : 0.0f;
  } else {
    load_f32x8(out + e0, acc);
  }
  for (int j = k; j < N && keys[j] == id; ++j) {
    float g[8];
    load_bf16x8(dx + static_cast<std::size_t>(positions[j]) * C + v * 8, g);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] += g[i];
  }
  if (kRange) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (e0 + i >= lo && e0 + i < hi) out[e0 + i - lo] = acc[i];
  } else {
    store_f32x8(out + e0, acc);
  }
}

static void check_shape(const char* op, int N, int C) {
  QT_CUDA_REQUIRE(N >= 0, std::string(op) + ": N must be >= 0, got " + std::to_string(N));
  QT_CUDA_REQUIRE(
      C > 0 && C % 8 == 0,
      std::string(op) + ": C must be a positive multiple of 8, got " + std::to_string(C));
}

static void check_aligned(const char* op, const char* name, const void* p) {
  QT_CUDA_REQUIRE(is_aligned16(p), std::string(op) + ": " + name + " must be 16-byte aligned");
}

static void embedding_forward_impl(const char* op, bf16* x, const std::int32_t* ids,
                                   const bf16* wte, int N, int C, std::int64_t first,
                                   std::int64_t count, cudaStream_t stream) {
  check_shape(op, N, C);
  check_aligned(op, "x", x);
  check_aligned(op, "wte", wte);
  if (N == 0) return;
  const std::int64_t threads = static_cast<std::int64_t>(N) * (C / 8);
  const auto grid = static_cast<unsigned int>(ceil_div<std::int64_t>(threads, kThreads));
  embedding_forward_kernel<<<grid, kThreads, 0, stream>>>(x, ids, wte, N, C, first, count);
  QT_CHECK_LAUNCH();
}

void embedding_forward(bf16* x, const std::int32_t* ids, const bf16* wte, int N, int C,
                       cudaStream_t stream) {
  embedding_forward_impl("embedding_forward", x, ids, wte, N, C, 0, INT64_MAX, stream);
}

void embedding_forward_rows(bf16* x, const std::int32_t* ids, const bf16* wte, int N, int C,
                            std::int64_t first, std::int64_t count, cudaStream_t stream) {
  QT_CUDA_REQUIRE(first >= 0 && count >= 0, "embedding_forward_rows: rows [" +
                                                std::to_string(first) + ", +" +
                                                std::to_string(count) + ")");
  embedding_forward_impl("embedding_forward_rows", x, ids, wte, N, C, first, count, stream);
}

// Workspace layout, each part 256-byte aligned: keys_in, keys_out [N] uint32; pos_in, pos_out
// [N] int32; then the radix sort's temporary storage.
namespace {
struct SortWorkspace {
  std::uint32_t* keys_in;
  std::uint32_t* keys_out;
  std::int32_t* pos_in;
  std::int32_t* pos_out;
  void* temp;
  std::size_t temp_bytes;
  std::size_t total;
};

std::size_t round256(std::size_t b) { return (b + 255) / 256 * 256; }

// ids are < 2^31: the sort needs bits [0, 31) only.
constexpr int kKeyBits = 31;

SortWorkspace sort_workspace(void* base, int N) {
  SortWorkspace w{};
  std::size_t temp_bytes = 0;
  QT_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(
      nullptr, temp_bytes, static_cast<const std::uint32_t*>(nullptr),
      static_cast<std::uint32_t*>(nullptr), static_cast<const std::int32_t*>(nullptr),
      static_cast<std::int32_t*>(nullptr), N, 0, kKeyBits));
  const std::size_t part = round256(static_cast<std::size_t>(N) * 4);
  char* p = static_cast<char*>(base);
  w.keys_in = reinterpret_cast<std::uint32_t*>(p);
  w.keys_out = reinterpret_cast<std::uint32_t*>(p + part);
  w.pos_in = reinterpret_cast<std::int32_t*>(p + 2 * part);
  w.pos_out = reinterpret_cast<std::int32_t*>(p + 3 * part);
  w.temp = p + 4 * part;
  w.temp_bytes = temp_bytes;
  w.total = 4 * part + round256(temp_bytes);
  return w;
}
}  // namespace

std::size_t embedding_backward_workspace_bytes(int N) {
  return sort_workspace(nullptr, std::max(N, 1)).total;
}

// Sorts (ids, positions) into the workspace, then the segmented sum into `out`.
template <bool kRange>
static void embedding_backward_impl(const char* op, float* out, std::size_t lo, std::size_t hi,
                                    const bf16* dx, const std::int32_t* ids, int N, int C,
                                    void* workspace, std::size_t workspace_bytes,
                                    cudaStream_t stream) {
  check_shape(op, N, C);
  if (!kRange) check_aligned(op, "dwte", out);
  check_aligned(op, "dx", dx);
  check_aligned(op, "workspace", workspace);
  if (N == 0) return;
  SortWorkspace w = sort_workspace(workspace, N);
  QT_CUDA_REQUIRE(workspace_bytes >= w.total, std::string(op) + ": workspace of " +
                                                  std::to_string(workspace_bytes) +
                                                  " bytes, needs " + std::to_string(w.total));
  embedding_sort_input_kernel<<<ceil_div(N, kThreads), kThreads, 0, stream>>>(w.keys_in, w.pos_in,
                                                                              ids, N);
  QT_CHECK_LAUNCH();
  // Radix sort is stable: equal ids keep their ascending positions.
  QT_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(w.temp, w.temp_bytes, w.keys_in, w.keys_out,
                                                w.pos_in, w.pos_out, N, 0, kKeyBits, stream));
  const dim3 grid(N, ceil_div(C / 8, kBwdThreads));
  embedding_backward_kernel<kRange><<<grid, kBwdThreads, 0, stream>>>(out, dx, w.keys_out,
                                                                      w.pos_out, N, C, lo, hi);
  QT_CHECK_LAUNCH();
}

void embedding_backward(float* dwte, const bf16* dx, const std::int32_t* ids, int N, int C,
                        void* workspace, std::size_t workspace_bytes, cudaStream_t stream) {
  embedding_backward_impl<false>("embedding_backward", dwte, 0, 0, dx, ids, N, C, workspace,
                                 workspace_bytes, stream);
}

void embedding_backward_range(float* out, std::size_t lo, std::size_t hi, const bf16* dx,
                              const std::int32_t* ids, int N, int C, void* workspace,
                              std::size_t workspace_bytes, cudaStream_t stream) {
  QT_CUDA_REQUIRE(lo <= hi, "embedding_backward_range: lo " + std::to_string(lo) + " > hi " +
                                std::to_string(hi));
  embedding_backward_impl<true>("embedding_backward_range", out, lo, hi, dx, ids, N, C, workspace,
                                workspace_bytes, stream);
}

}  // namespace qt::cuda
