// `qtrain plan DECK --gpus N --gpu-mem GB`: the GPU memory one rank of the CUDA back end needs for
// the deck's model and micro-batch, for every ZeRO stage (0-3) and offload (none, cpu) on N
// data-parallel GPUs, whether each fits, and the cheapest setting that does (docs/plan.md). The
// numbers come from plan/memory_plan.h. Serial: under mpirun every rank computes, rank 0 prints.
#pragma once

namespace qt {

class MpiComm;

// argv[0] is "plan"; then the deck, --gpus N, --gpu-mem GB and --section.key=value overrides of
// the deck (--help lists them). Returns the exit code: 0, or 2 (kExitBadInput) after rank 0
// printed "qtrain plan: error: ...".
int plan_main(int argc, char** argv, const MpiComm& world);

}  // namespace qt
