// The device communicators (NCCL) a CUDA training rank of a mesh uses, those of more than one
// rank: tp, dp, a Qwen3-MoE model's ep and expert-dp, and the pipeline's channels
// (cuda_pipeline_channels). One list for the two places that must agree: the CUDA back end
// connects them before it sizes its arena (cuda::connect_before_arena) and `qtrain plan` counts
// their memory (plan::nccl_bytes).
#pragma once

#include <vector>

#include "parallel/pipeline_schedule.h"
#include "qtrain/mesh.h"

namespace qt {

struct DeviceCommunicator {
  MeshDim dim;
  int channel = 0;  // the pipeline's channels; 0 for the others
};

// moe: a Qwen3-MoE model (its ep and expert-dp groups exist only then).
inline std::vector<DeviceCommunicator> device_communicators(const MeshShape& m, bool moe) {
  std::vector<DeviceCommunicator> c;
  if (m.tp > 1) c.push_back({MeshDim::kTp});
  if (m.dp > 1) c.push_back({MeshDim::kDp});
  if (moe && m.ep > 1) {
    c.push_back({MeshDim::kEp});
    if (m.dp / m.ep > 1) c.push_back({MeshDim::kEdp});
  }
  if (m.pp > 1)
    for (int ch = 0; ch < cuda_pipeline_channels(m.pp_chunks); ++ch)
      c.push_back({MeshDim::kPp, ch});
  return c;
}

}  // namespace qt
