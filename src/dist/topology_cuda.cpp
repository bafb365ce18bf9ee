// The GPU half of the topology report (topology.h) and of `qtrain probe` (probe.h), CUDA builds
// only: the GPUs this process sees, their PCI bus ids, how each pair is linked, and NCCL
// all-reduces timed on the rank's GPU. NVML is loaded at run time
// (dlopen("libnvidia-ml.so.1"), the driver's library; no header or link dependency): the number
// of active NVLinks of each GPU and NVML's NVLink P2P status of each pair. Without it, CUDA's peer
// access tells only whether a pair can reach each other directly, not over what.
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <fmt/format.h>

#include "cuda/check.h"
#include "cuda/device.h"
#include "cuda/nccl_comm.h"
#include "dist/probe.h"
#include "dist/topology.h"

namespace qt {

namespace {

// The few NVML declarations used, as nvml.h has them (C ABI, stable since NVML 5).
using nvmlReturn_t = int;
using nvmlDevice_t = struct nvmlDevice_st*;
constexpr nvmlReturn_t kNvmlSuccess = 0;
constexpr int kNvmlFeatureEnabled = 1;     // nvmlEnableState_t NVML_FEATURE_ENABLED
constexpr int kNvmlP2PCapsNvLink = 2;      // nvmlGpuP2PCapsIndex_t NVML_P2P_CAPS_INDEX_NVLINK
constexpr int kNvmlP2PStatusOk = 0;        // nvmlGpuP2PStatus_t NVML_P2P_STATUS_OK
constexpr unsigned kNvmlNvLinkMaxLinks = 18;  // NVML_NVLINK_MAX_LINKS (Hopper and Blackwell: 18)

// libnvidia-ml.so.1, initialised, or not there (ok() false).
class Nvml {
 public:
  Nvml() {
    lib_ = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib_) return;
    init_ = reinterpret_cast<nvmlReturn_t (*)()>(dlsym(lib_, "nvmlInit_v2"));
    shutdown_ = reinterpret_cast<nvmlReturn_t (*)()>(dlsym(lib_, "nvmlShutdown"));
    by_bus_ = reinterpret_cast<nvmlReturn_t (*)(const char*, nvmlDevice_t*)>(
        dlsym(lib_, "nvmlDeviceGetHandleByPciBusId_v2"));
    link_state_ = reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, unsigned, int*)>(
        dlsym(lib_, "nvmlDeviceGetNvLinkState"));
    p2p_ = reinterpret_cast<nvmlReturn_t (*)(nvmlDevice_t, nvmlDevice_t, int, int*)>(
        dlsym(lib_, "nvmlDeviceGetP2PStatus"));
    ok_ = init_ && shutdown_ && by_bus_ && link_state_ && p2p_ && init_() == kNvmlSuccess;
  }
  ~Nvml() {
    if (ok_) shutdown_();
    if (lib_) dlclose(lib_);
  }
  Nvml(const Nvml&) = delete;
  Nvml& operator=(const Nvml&) = delete;

  bool ok() const { return ok_; }
  nvmlDevice_t device(const std::string& bus_id) const {
    nvmlDevice_t d = nullptr;
    return by_bus_(bus_id.c_str(), &d) == kNvmlSuccess ? d : nullptr;
  }
  int active_links(nvmlDevice_t d) const {
    int n = 0;
    for (unsigned l = 0; l < kNvmlNvLinkMaxLinks; ++l) {
      int state = 0;
      if (link_state_(d, l, &state) == kNvmlSuccess && state == kNvmlFeatureEnabled) ++n;
    }
    return n;
  }
  bool nvlink(nvmlDevice_t a, nvmlDevice_t b) const {
    int status = -1;
    return p2p_(a, b, kNvmlP2PCapsNvLink, &status) == kNvmlSuccess && status == kNvmlP2PStatusOk;
  }

 private:
  void* lib_ = nullptr;
  bool ok_ = false;
  nvmlReturn_t (*init_)() = nullptr;
  nvmlReturn_t (*shutdown_)() = nullptr;
  nvmlReturn_t (*by_bus_)(const char*, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*link_state_)(nvmlDevice_t, unsigned, int*) = nullptr;
  nvmlReturn_t (*p2p_)(nvmlDevice_t, nvmlDevice_t, int, int*) = nullptr;
};

}  // namespace

LocalGpus query_local_gpus(bool with_links) {
  LocalGpus g;
  int n = 0;
  const cudaError_t rc = cudaGetDeviceCount(&n);
  if (rc != cudaSuccess) {
    cudaGetLastError();  // not sticky: the report carries on
    g.count = 0;
    g.error = cudaGetErrorString(rc);
    return g;
  }
  g.count = n;
  if (n == 0) {
    g.error = "none visible";
    return g;
  }
  for (int i = 0; i < n; ++i) {
    char bus[32] = "";
    if (cudaDeviceGetPCIBusId(bus, sizeof bus, i) != cudaSuccess) cudaGetLastError();
    g.bus_ids.push_back(bus);
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) g.name = prop.name;
  else cudaGetLastError();
  if (!with_links) return g;

  const Nvml nvml;
  std::vector<nvmlDevice_t> dev(n, nullptr);
  std::vector<int> nvlinks;
  bool all_known = nvml.ok();
  for (int i = 0; i < n && nvml.ok(); ++i) {
    dev[i] = nvml.device(g.bus_ids[i]);
    if (!dev[i]) all_known = false;
    else nvlinks.push_back(nvml.active_links(dev[i]));
  }
  if (!all_known) nvlinks.clear();
  // kind[i * n + j]: NVML's NVLink status first, else CUDA's peer access (PCIe when NVML said
  // "no NVLink", unnamed when NVML is missing).
  std::vector<GpuLink> kind(static_cast<std::size_t>(n) * n, GpuLink::kUnknown);
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) {
      if (i == j) continue;
      GpuLink& k = kind[static_cast<std::size_t>(i) * n + j];
      if (all_known && nvml.nvlink(dev[i], dev[j])) {
        k = GpuLink::kNvLink;
        continue;
      }
      int peer = 0;
      if (cudaDeviceCanAccessPeer(&peer, i, j) != cudaSuccess) {
        cudaGetLastError();
        continue;
      }
      k = !peer ? GpuLink::kNoPeer : all_known ? GpuLink::kPcie : GpuLink::kPeer;
    }
  g.links = gpu_links_text(n, kind, nvlinks);
  if (!all_known && n > 1)
    g.links += nvml.ok() ? " (NVML knows not every GPU)" : " (libnvidia-ml.so.1 not loaded)";
  return g;
}

double time_device_all_reduce(const MpiComm& group, int local_rank, std::size_t count, int warmup,
                              int iters) {
  cuda::select_device(local_rank);
  cuda::NcclComm nccl(group, group.name());
  cuda::DeviceBuffer buf(count * sizeof(float), "the probe's all-reduce buffer");
  QT_CHECK_CUDA(cudaMemset(buf.get(), 0, buf.bytes()));  // zeros: no overflow however many sums
  QT_CHECK_CUDA(cudaDeviceSynchronize());
  return time_all_reduce(nccl, group, buf.get(), count, warmup, iters);
}

}  // namespace qt
