// `qtrain plan DECK --gpus N --gpu-mem GB`: every layout of the deck's model on N GPUs of the CUDA
// back end (dp x tp x pp meshes, ZeRO stages, offload, recompute), the GPU memory one rank needs
// for each, whether it fits, its predicted step time, and the recommended layout with its deck
// keys (docs/plan.md). The numbers come from plan/layouts.h, memory_plan.h and step_time.h.
// Serial: under mpirun every rank computes, rank 0 prints.
#pragma once

namespace qt {

class MpiComm;

// argv[0] is "plan"; then the deck, --gpus N, --gpu-mem GB and --section.key=value overrides of
// the deck (--help lists them). Returns the exit code: 0, or 2 (kExitBadInput) after rank 0
// printed "qtrain plan: error: ...".
int plan_main(int argc, char** argv, const MpiComm& world);

}  // namespace qt
