// The order in which a forward pass first uses a Qwen3 plan's units (the ZeRO-3 gather ring
// prefetches along it, a backward in reverse): the embedding, each decoder layer followed by its
// experts' unit when an expert-parallel layout gives them one (plan_qwen3 puts those after the
// head), the head; any other unit (LoRA's adapters) where the plan has it.
#pragma once

#include <vector>

#include "qtrain/shard_plan.h"

namespace qt {

std::vector<int> forward_unit_order(const ShardPlan& plan);

}  // namespace qt
