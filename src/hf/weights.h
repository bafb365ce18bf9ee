// The weights of a Hugging Face model directory, and loading them into the flat parameter buffer.
//
// A directory holds either one model.safetensors or model.safetensors.index.json, whose
// weight_map names the shard file of every tensor (transformers' order of preference). Every
// shard is memory-mapped; a rank reads only the row ranges it asks for, so only those pages are
// touched.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "hf/safetensors.h"
#include "qtrain/comm.h"
#include "qtrain/params.h"

namespace qt::hf {

class HfWeights {
 public:
  // Opens the directory's safetensors files; UserError naming the file and tensor on any problem
  // (no weights, a bad index, a tensor in two shards, an index entry missing from its shard).
  explicit HfWeights(const std::string& dir);

  struct Entry {
    const SafetensorsFile* file = nullptr;
    const StTensor* tensor = nullptr;
  };
  const std::map<std::string, Entry>& tensors() const { return tensors_; }
  const Entry* find(const std::string& name) const;
  // Rows [r0, r1) of tensor `name` as fp32 into out[(r1 - r0) * row_elems].
  void read_rows(const std::string& name, std::int64_t r0, std::int64_t r1, float* out) const;
  // How the weights were found, e.g. "model.safetensors" or "2 shards (model.safetensors.index.json)".
  const std::string& describe() const { return describe_; }

 private:
  std::string dir_, describe_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, Entry> tensors_;
};

// Rows [row_begin, row_end) of one parameter that a rank needs; with tp = pp = 1 every rank needs
// every row of every parameter, a tensor-parallel rank will ask for its shard's rows.
struct RowSlice {
  const ParamInfo* param = nullptr;
  std::int64_t row_begin = 0, row_end = 0;
  float* dst = nullptr;  // [(row_end - row_begin) * row elements]
};

// Every row of every parameter of `layout`, into the flat buffer `params`.
std::vector<RowSlice> all_rows(const ParamLayout& layout, float* params);

// Collective over `world`. Checks the directory's tensors against `layout` (a missing,
// unexpected, wrongly shaped or wrongly typed tensor is a UserError naming it, thrown on every
// rank alike) and reads `slices`. A Qwen3-MoE layer's experts may be stored per expert (the
// checkpoint names) or fused (the layout's names), not both (hf/moe_weights.h); a row of a fused
// expert parameter is one expert. lm_head.weight in a model with tied embeddings is ignored, as
// transformers does; rank 0 warns when it differs from model.embed_tokens.weight. Returns a line
// for the log.
std::string load_params(const std::string& dir, const ParamLayout& layout,
                        const std::vector<RowSlice>& slices, bool tied_embeddings, Comm& world);
// The same for the flat ranges `pieces` of `layout` (a sharded state's; a piece may start and
// end inside a row), read through slices of whole rows: the rows inside a piece straight into
// it, a row that a piece cuts (at most two per piece and tensor) staged in host memory.
std::string load_params(const std::string& dir, const ParamLayout& layout,
                        const std::vector<FlatPiece>& pieces, bool tied_embeddings, Comm& world);

}  // namespace qt::hf
