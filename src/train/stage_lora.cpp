// LoRA on a pipeline stage of the CPU back end (see stage_lora.h).
#include "train/stage_lora.h"

#include "qtrain/error.h"

namespace qt {

namespace {
std::vector<std::pair<int, int>> layer_ranges(const std::vector<StageLora::ChunkLayers>& chunks) {
  std::vector<std::pair<int, int>> ranges;
  for (const StageLora::ChunkLayers& c : chunks) ranges.push_back({c.first_layer, c.last_layer});
  return ranges;
}

}  // namespace

ParamLayout StageLora::stage_layout(const ModelConfig& local, const LoraConfig& lora,
                                    const std::vector<ChunkLayers>& chunks) {
  return lora_layout(local, lora, layer_ranges(chunks));
}

StageLora::StageLora(const Deck& deck, const ModelConfig& local, const ShardPlan& model_plan,
                     const std::vector<int>& held, const std::vector<ChunkLayers>& chunks,
                     const MeshShape& mesh, Comm* pp, int tp_rank, int ep_rank)
    : base_at_(model_plan.units.size(), -1),
      layout_(stage_layout(local, deck.lora, chunks)),
      global_layout_(lora_layout(deck.model, deck.lora)),
      plan_(plan_adapters(layout_, mesh, deck.optim.zero_stage,
                          tp_kv_replicas(deck.model, mesh.tp))),
      map_(lora_map(deck.model, deck.lora, layer_ranges(chunks), global_layout_, layout_, plan_,
                    mesh, tp_rank, ep_rank)),
      share_{plan_.unit_indices(), pp, -1} {
  std::size_t n = 0;
  for (const int u : held) {
    base_at_.at(static_cast<std::size_t>(u)) = static_cast<std::int64_t>(n);
    n += model_plan.units[static_cast<std::size_t>(u)].range.size();
  }
  base_.assign(n, 0.0f);
  for (const ParamUnit& u : model_plan.units) base_ranges_.push_back(u.range);
  std::size_t at = 0;
  for (const ChunkLayers& c : chunks) {
    adapters_.push_back(std::make_unique<LoraAdapters>(local, deck.lora, deck.train.micro_batch,
                                                       deck.train.seq_len, c.first_layer,
                                                       c.last_layer, c.slots));
    LoraAdapters& a = *adapters_.back();
    if (mesh.tp > 1) a.set_tensor_parallel(mesh.tp, tp_rank);
    // The chunk's tensors are the stage layout's from `at` on, in the same order.
    const ParamInfo& first = layout_.find(a.layout().params().front().name);
    QT_CHECK(first.offset == at, "chunk adapters at {}, expected {}", first.offset, at);
    offset_.push_back(at);
    at += a.layout().numel();
  }
  QT_CHECK(at == layout_.numel(), "the chunks' adapters hold {} of the stage's {}", at,
           layout_.numel());
}

const float* StageLora::params(int u) {
  const std::int64_t at = base_at_.at(static_cast<std::size_t>(u));
  QT_CHECK(at >= 0, "base unit {} is not held by this stage", u);
  return base_.data() + at;
}

std::vector<FlatPiece> StageLora::base_pieces() {
  std::vector<FlatPiece> out;
  for (std::size_t u = 0; u < base_at_.size(); ++u)
    if (base_at_[u] >= 0) out.push_back({base_ranges_[u], base_.data() + base_at_[u]});
  return out;
}

void StageLora::bind(const AdapterBuffers<float>& buffers) {
  for (std::size_t v = 0; v < adapters_.size(); ++v)
    adapters_[v]->bind(
        buffers.part(Range{offset_[v], offset_[v] + adapters_[v]->layout().numel()}));
}

void StageLora::set_dropout_key(std::uint64_t seed, std::int64_t first_sample) {
  for (auto& a : adapters_) a->set_dropout_key(seed, first_sample);
}

}  // namespace qt
