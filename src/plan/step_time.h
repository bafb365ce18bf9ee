// The predicted time of one optimizer step of a layout (`qtrain plan`, docs/plan.md): a roofline
// over measured rates. Compute at the GEMM and attention rates of one GPU; collectives as bytes
// over the bus bandwidth of the link they cross (topology.*: NVLink inside a host, the network
// across hosts) plus a latency each; the pipeline's step from the schedule's own simulation
// (parallel/pipeline_schedule.h) with the slowest stage's costs; ZeRO's gathers and
// reduce-scatters beside the compute on their own stream; AdamW at the memory's pace, or on the
// host with offload.
//
// Every rate is in kRates, with where it was measured. The model is deliberately simple: it
// ranks layouts and says where a step's time goes; it does not replace a measurement.
#pragma once

#include "plan/memory_plan.h"
#include "qtrain/deck.h"

namespace qt::plan {

// The rates of one H100 SXM 80GB (an H200 computes at the same rates; its faster memory makes
// AdamW about 1.4x faster than predicted here). docs/performance.md has the measurements.
struct Rates {
  // GEMMs and the elementwise work around them, in model FLOPs (2 a multiply-add): what the
  // measured whole-step rate of 8 Qwen3-8B-shaped layers at 2 x 4096 tokens on one H100
  // (37.64k tokens/s, 550 model TFLOP/s, 55.6% MFU) leaves after attention at its rate below
  // and AdamW at its bandwidth: 595 TFLOP/s (the GEMMs alone run at 620-720 under Nsight).
  double gemm_flops = 595e12;
  // The experts' grouped GEMMs of a Qwen3-MoE sparse layer (forward, input and weight
  // gradients of gate_up and down; the wgmma kernel, qtrain_bench_grouped_gemm_cuda on an H100 at
  // Qwen3-30B-A3B's shapes, 65,536 rows spread log-normally over 128 experts: 4.85 ms a layer
  // for 1.855 TFLOP): 382 TFLOP/s.
  double expert_gemm_flops = 382e12;
  // Causal flash attention forward + backward (forward 2 T Q a token, backward 2.5x that):
  // qtrain_bench_attention_cuda, nh 16, T 4096, warp-specialised kernels: 450 TFLOP/s.
  double attention_flops = 450e12;
  // The dense bf16 peak of an H100 SXM (and H200), for MFU.
  double peak_flops = 989e12;
  // The fused AdamW kernel: 30 bytes an updated parameter at 2,984 GB/s (qtrain_bench_cuda_ops,
  // 99% of the device copy rate).
  double adamw_bytes_per_s = 2984e9;
  // offload: host AdamW of one node, parameters a second, shared by its ranks. Estimated from
  // Qwen3-8B ZeRO-3 + offload on one H200 (7,939 tokens/s at 16 x 4096 a step: about 2.3 s of
  // the 8.25 s step is the host update of 8.2e9 parameters that the GPU does not hide).
  double host_adamw_params_per_s = 3.5e9;
  // offload: host <-> GPU copies, per GPU (PCIe 5 x16, pinned; an assumption, not measured here).
  double pcie_bytes_per_s = 25e9;
  // Data-parallel communication beside the compute slows it: each second of gathers and
  // reduce-scatters on the NCCL stream adds this many seconds to the forward and backward (NCCL's
  // SMs and memory traffic taken from the GEMMs). Two H200s, ZeRO-3 (docs/performance.md, "Where
  // the ZeRO-3 step goes"): Qwen3-8B's forward + backward 404.5 ms against 351 ms of compute and
  // 94 ms of collectives (0.57); Qwen3-1.7B +19.6 ms for 20 ms of collectives (about 1).
  double dp_interference = 0.6;
  // A collective's or message's fixed cost (NCCL small-message latency; assumptions).
  double latency_intra_s = 10e-6;
  double latency_inter_s = 30e-6;
};
inline constexpr Rates kRates{};

// Where one step's time goes, in seconds; the parts sum to total.
struct StepTime {
  double compute = 0;     // forward and backward of the step's micro-batches (the slowest stage)
  double tp_comm = 0;     // tensor parallelism's all-reduces (sequence parallel: all-gathers and
                          // reduce-scatters), not overlapped
  double ep_comm = 0;     // expert parallelism's all-to-alls (dispatch and combine), not
                          // overlapped
  double pp_comm = 0;     // the pipeline's sends of activations and their gradients
  double dp_exposed = 0;  // data-parallel gathers and reductions the compute does not hide
  double bubble = 0;      // pipeline stages idle
  double optimizer = 0;   // the update (and ZeRO-1/2's gather of updated weights beside it)
  double total = 0;
  double bubble_fraction = 0;       // of the pipeline's time (schedule simulation)
  double tokens_per_s_per_gpu = 0;  // the step's tokens over total and the GPUs
  double mfu = 0;                   // model FLOPs (6 params + 12 L Q T a token) over peak
};

// The step of `in` (mesh dp x tp x pp GPUs; in.micro_batches micro-batches a dp rank) on the
// links of `topo`. Validates as memory_plan does.
StepTime step_time(const MemoryPlanInput& in, const TopologyConfig& topo,
                   const Rates& rates = kRates);

// A group of `size` ranks `stride` apart (world ranks 0, stride, ...) stays inside one host of
// gpus_per_host GPUs: its span fits a host and hosts hold whole spans.
bool group_inside_host(int stride, int size, int world, int gpus_per_host);

}  // namespace qt::plan
