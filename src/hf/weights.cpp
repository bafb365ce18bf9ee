// Hugging Face weights: the directory's safetensors files and the import into the flat buffer.
#include "hf/weights.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "hf/moe_weights.h"
#include "io/json_file.h"
#include "qtrain/error.h"

namespace qt::hf {

namespace fs = std::filesystem;

namespace {

// At most `max` names, then "and N more".
std::string name_list(const std::vector<std::string>& names, std::size_t max = 5) {
  std::string out;
  for (std::size_t i = 0; i < names.size() && i < max; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > max) out += fmt::format(" and {} more", names.size() - max);
  return out;
}

std::string shape_text(const std::vector<std::int64_t>& s) {
  return fmt::format("[{}]", fmt::join(s, ", "));
}

}  // namespace

HfWeights::HfWeights(const std::string& dir) : dir_(dir) {
  const fs::path single = fs::path(dir) / "model.safetensors";
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  std::error_code ec;
  std::vector<std::string> files;                // relative to dir
  std::map<std::string, std::string> weight_map;  // tensor -> file, from the index
  if (fs::is_regular_file(single, ec)) {
    files.push_back("model.safetensors");
    describe_ = "model.safetensors";
  } else if (fs::is_regular_file(index, ec)) {
    nlohmann::json j = io::read_json_file(index.string());
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object() ||
        j["weight_map"].empty())
      fail_user("{}: no \"weight_map\" object naming the shard of every tensor", index.string());
    std::set<std::string> distinct;
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      if (!it.value().is_string())
        fail_user("{}: weight_map[\"{}\"] is not a file name", index.string(), it.key());
      const std::string f = it.value().get<std::string>();
      const fs::path rel(f);
      if (f.empty() || rel.is_absolute() ||
          std::any_of(rel.begin(), rel.end(), [](const fs::path& c) { return c == ".."; }))
        fail_user("{}: weight_map[\"{}\"] = \"{}\" is not a file inside the directory",
                  index.string(), it.key(), f);
      weight_map[it.key()] = f;
      if (distinct.insert(f).second) files.push_back(f);
    }
    describe_ = fmt::format("{} shard{} ({})", files.size(), files.size() == 1 ? "" : "s",
                            index.filename().string());
  } else {
    fail_user("{}: no model.safetensors or model.safetensors.index.json (qtrain reads safetensors "
              "weights; save the model with transformers' save_pretrained first)", dir);
  }
  for (const std::string& f : files) {
    const fs::path p = fs::path(dir) / f;
    if (!fs::is_regular_file(p, ec))
      fail_user("{}: shard {} named by {} does not exist", dir, f, index.filename().string());
    files_.push_back(std::make_unique<SafetensorsFile>(p.string()));
    const SafetensorsFile& sf = *files_.back();
    for (const StTensor& t : sf.tensors()) {
      auto [it, fresh] = tensors_.emplace(t.name, Entry{&sf, &t});
      if (!fresh)
        fail_user("{}: tensor \"{}\" is in two files: {} and {}", dir, t.name,
                  it->second.file->path(), sf.path());
    }
  }
  for (const auto& [name, f] : weight_map) {
    const Entry* e = find(name);
    const fs::path want = fs::path(dir) / f;
    if (!e || fs::path(e->file->path()) != want)
      fail_user("{}: weight_map puts tensor \"{}\" in {}, but that file has no such tensor",
                index.string(), name, f);
  }
}

const HfWeights::Entry* HfWeights::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

void HfWeights::read_rows(const std::string& name, std::int64_t r0, std::int64_t r1,
                          float* out) const {
  const Entry* e = find(name);
  QT_CHECK(e != nullptr, "tensor {} not in {}", name, dir_);
  e->file->read_rows_f32(*e->tensor, r0, r1, out);
}

std::vector<RowSlice> all_rows(const ParamLayout& layout, float* params) {
  std::vector<RowSlice> out;
  for (const ParamInfo& p : layout.params())
    out.push_back({&p, 0, p.shape.empty() ? 1 : p.shape[0], params + p.offset});
  return out;
}

namespace {

// Where a layout parameter's values are in the directory's files: the tensor of its own name
// and shape, or (rows not empty) a Qwen3-MoE layer's experts stored per expert, row e of the
// parameter being the concatenation of the file tensors rows[e] (moe_weights.h).
struct Source {
  std::vector<std::vector<FileTensor>> rows;
};

// Matches every parameter of `layout` with the tensors of `w`, in layout order. UserError for a
// missing, unexpected, wrongly shaped or typed tensor, or experts stored both fused and per expert.
std::vector<Source> match_tensors(const HfWeights& w, const ParamLayout& layout,
                                  bool tied_embeddings, const std::string& dir) {
  std::vector<Source> sources;
  std::set<std::string> used;
  std::vector<std::string> missing, unexpected;
  auto take = [&](const std::string& name, const std::vector<std::int64_t>& shape) {
    const HfWeights::Entry* e = w.find(name);
    if (!e) {
      missing.push_back(name);
      return;
    }
    if (e->tensor->shape != shape)
      fail_user("{}: tensor {} has shape {}, the model of config.json needs {}", e->file->path(),
                name, shape_text(e->tensor->shape), shape_text(shape));
    if (!st_dtype_is_float_readable(e->tensor->dtype))
      fail_user("{}: tensor {} has dtype {}; qtrain reads BF16, F16 and F32 weights",
                e->file->path(), name, st_dtype_name(e->tensor->dtype));
    used.insert(name);
  };
  for (const ParamInfo& p : layout.params()) {
    Source s;
    auto per_expert = expert_file_tensors(p);
    if (!per_expert.empty() && !w.find(p.name)) {  // experts per expert, as checkpoints hold them
      s.rows = std::move(per_expert);
      for (const auto& row : s.rows)
        for (const FileTensor& t : row) take(t.name, t.shape);
    } else {  // the parameter's own name (experts fused): no per-expert copy may be there too
      take(p.name, p.shape);
      for (const auto& row : per_expert)
        for (const FileTensor& t : row)
          if (const HfWeights::Entry* e = w.find(t.name))
            fail_user("{}: tensor {} holds experts that {} holds too (fused); a layer's experts "
                      "must be stored once, fused or per expert",
                      e->file->path(), t.name, p.name);
    }
    sources.push_back(std::move(s));
  }
  for (const auto& [name, e] : w.tensors()) {
    if (name == "lm_head.weight" && tied_embeddings) continue;  // tied: ignored (load_params)
    if (!used.contains(name)) unexpected.push_back(name);
  }
  const auto experts_in = [](const std::vector<std::string>& names) {
    return std::any_of(names.begin(), names.end(), is_expert_file_tensor);
  };
  if (!missing.empty())
    fail_user("{}: {} tensor{} of the model {} missing: {}{}", dir, missing.size(),
              missing.size() == 1 ? "" : "s", missing.size() == 1 ? "is" : "are",
              name_list(missing),
              experts_in(missing)
                  ? " (a sparse layer's experts are read per expert, mlp.experts.{e}.gate_proj, "
                    "up_proj and down_proj.weight, or fused, mlp.experts.gate_up_proj [E, 2 Im, "
                    "H] and mlp.experts.down_proj [E, H, Im])"
                  : "");
  if (!unexpected.empty())
    fail_user("{}: {} unexpected tensor{} that a Qwen3 model of this config.json does not have: "
              "{}{}", dir, unexpected.size(), unexpected.size() == 1 ? "" : "s",
              name_list(unexpected),
              experts_in(unexpected)
                  ? " (config.json's num_experts, mlp_only_layers and decoder_sparse_step say "
                    "which layers are sparse and how many experts they have)"
                  : "");
  return sources;
}

// Rows [r0, r1) of file tensor `name` into `out`, refusing a non-finite value.
void read_finite(const HfWeights& w, const std::string& dir, const std::string& name,
                 std::int64_t r0, std::int64_t r1, float* out) {
  w.read_rows(name, r0, r1, out);
  const HfWeights::Entry* e = w.find(name);
  const std::size_t per_row = static_cast<std::size_t>(e->tensor->row_elems());
  const std::size_t n = static_cast<std::size_t>(r1 - r0) * per_row;
  for (std::size_t i = 0; i < n; ++i)
    if (!std::isfinite(out[i]))
      fail_user("{}: tensor {} holds a non-finite value ({}) at element {}", dir, name, out[i],
                static_cast<std::size_t>(r0) * per_row + i);
}

}  // namespace

std::string load_params(const std::string& dir, const ParamLayout& layout,
                        const std::vector<RowSlice>& slices, bool tied_embeddings, Comm& world) {
  // 1. Open and check names, shapes and dtypes. Every rank reads the same files, so verdicts
  //    agree; agree() still guards against one rank's I/O failure hanging the others.
  std::unique_ptr<HfWeights> w;
  std::vector<Source> sources;  // [layout.params().size()]
  std::string err, line;
  try {
    w = std::make_unique<HfWeights>(dir);
    sources = match_tensors(*w, layout, tied_embeddings, dir);
    line = fmt::format("{} ({})", dir, w->describe());
  } catch (const UserError& e) {
    err = e.what();
  }
  agree(world, err);

  // 2. Read the rows this rank needs; refuse non-finite weights. A per-expert parameter's row
  //    is its expert's file tensors, whole, one after the other.
  std::map<std::string, std::size_t> index;  // parameter name -> its place in the layout
  for (std::size_t i = 0; i < layout.params().size(); ++i) index[layout.params()[i].name] = i;
  try {
    for (const RowSlice& s : slices) {
      const auto found = index.find(s.param->name);
      QT_CHECK(found != index.end(), "{}: a slice of {}, not a parameter of the layout", dir,
               s.param->name);
      const std::size_t i = found->second;
      if (sources[i].rows.empty()) {
        read_finite(*w, dir, s.param->name, s.row_begin, s.row_end, s.dst);
        continue;
      }
      float* at = s.dst;
      for (std::int64_t r = s.row_begin; r < s.row_end; ++r)
        for (const FileTensor& t : sources[i].rows[static_cast<std::size_t>(r)]) {
          read_finite(*w, dir, t.name, 0, t.shape[0], at);
          at += t.numel();
        }
    }
  } catch (const UserError& e) {
    err = e.what();
  }
  agree(world, err);

  // 3. A tied model's lm_head.weight: transformers ties it to the embedding and ignores the file's.
  if (const HfWeights::Entry* lm = w->find("lm_head.weight"); lm && tied_embeddings && world.rank() == 0) {
    const HfWeights::Entry* emb = w->find("model.embed_tokens.weight");
    bool same = lm->tensor->shape == emb->tensor->shape;
    std::vector<float> a, b;
    for (std::int64_t r = 0; same && r < emb->tensor->rows(); ++r) {
      a.resize(static_cast<std::size_t>(emb->tensor->row_elems()));
      b.resize(a.size());
      w->read_rows("lm_head.weight", r, r + 1, a.data());
      w->read_rows("model.embed_tokens.weight", r, r + 1, b.data());
      same = std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
    }
    if (!same)
      std::fprintf(stderr, "qtrain: warning: %s: lm_head.weight differs from model.embed_tokens.weight, "
                   "but tie_word_embeddings is true: lm_head.weight is ignored, as transformers does\n",
                   dir.c_str());
  }
  return line;
}

std::string load_params(const std::string& dir, const ParamLayout& layout,
                        const std::vector<FlatPiece>& pieces, bool tied_embeddings, Comm& world) {
  // Whole rows inside a piece are read straight into it; a row that a piece cuts (at most two
  // per piece and tensor) is read whole into a staging row, and its wanted part copied out.
  struct Cut {
    const ParamInfo* param;
    std::size_t row;            // the row staged
    std::size_t skip, len;      // the wanted part: its elements [skip, skip + len)
    float* dst;                 // [len]
    std::vector<float> staged;  // [row elements]
  };
  std::vector<RowSlice> slices;
  std::vector<Cut> cuts;
  const auto& ps = layout.params();  // in flat order, contiguous from 0
  for (const FlatPiece& f : pieces) {
    QT_CHECK(f.range.begin <= f.range.end && f.range.end <= layout.numel(),
             "{}: piece [{}, {}) outside the {} parameters", dir, f.range.begin, f.range.end,
             layout.numel());
    QT_CHECK(f.range.size() == 0 || f.data != nullptr, "{}: piece [{}, {}) has no buffer", dir,
             f.range.begin, f.range.end);
    if (f.range.size() == 0) continue;
    // The tensors the piece meets: from the last one starting at or before its first element.
    auto it = std::upper_bound(ps.begin(), ps.end(), f.range.begin,
                               [](std::size_t x, const ParamInfo& p) { return x < p.offset; });
    for (--it; it != ps.end() && it->offset < f.range.end; ++it) {
      const ParamInfo& p = *it;
      // Tensor-relative elements [lo, hi), rows of w elements.
      const std::size_t lo = std::max(f.range.begin, p.offset) - p.offset;
      const std::size_t hi = std::min(f.range.end, p.offset + p.numel) - p.offset;
      if (lo >= hi) continue;
      const std::size_t rows = p.shape.empty() ? 1 : static_cast<std::size_t>(p.shape[0]);
      const std::size_t w = p.numel / rows;
      float* at_lo = f.data + (p.offset + lo - f.range.begin);  // where element lo goes
      // Stages elements [a, b) of row `row`.
      auto cut = [&](std::size_t row, std::size_t a, std::size_t b) {
        cuts.push_back({&p, row, a, b - a, at_lo + (row * w + a - lo), {}});
      };
      // Whole rows [first, end); first > end when [lo, hi) lies inside one row.
      const std::size_t first = (lo + w - 1) / w, end = hi / w;
      if (first > end) {
        cut(lo / w, lo % w, hi % w);
        continue;
      }
      if (lo % w != 0) cut(lo / w, lo % w, w);
      if (first < end)
        slices.push_back({&p, static_cast<std::int64_t>(first), static_cast<std::int64_t>(end),
                          at_lo + (first * w - lo)});
      if (hi % w != 0) cut(end, 0, hi % w);
    }
  }
  for (Cut& c : cuts) {
    c.staged.resize(c.param->numel /
                    (c.param->shape.empty() ? 1 : static_cast<std::size_t>(c.param->shape[0])));
    slices.push_back({c.param, static_cast<std::int64_t>(c.row),
                      static_cast<std::int64_t>(c.row + 1), c.staged.data()});
  }
  const std::string line = load_params(dir, layout, slices, tied_embeddings, world);
  for (const Cut& c : cuts) std::copy_n(c.staged.data() + c.skip, c.len, c.dst);
  return line;
}

}  // namespace qt::hf
