// Hugging Face weights: the directory's safetensors files and the import into the flat buffer.
#include "hf/weights.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

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
    std::ifstream in(index, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(ss.str());
    } catch (const nlohmann::json::exception& e) {
      fail_user("{}: not valid JSON: {}", index.string(), e.what());
    }
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

std::string load_params(const std::string& dir, const ParamLayout& layout,
                        const std::vector<RowSlice>& slices, bool tied_embeddings, Comm& world) {
  // 1. Open and check names, shapes and dtypes. Every rank reads the same files, so verdicts
  //    agree; agree() still guards against one rank's I/O failure hanging the others.
  std::unique_ptr<HfWeights> w;
  std::string err, line;
  try {
    w = std::make_unique<HfWeights>(dir);
    std::vector<std::string> missing, unexpected;
    for (const ParamInfo& p : layout.params()) {
      const HfWeights::Entry* e = w->find(p.name);
      if (!e) {
        missing.push_back(p.name);
        continue;
      }
      if (e->tensor->shape != p.shape)
        fail_user("{}: tensor {} has shape {}, the model of config.json needs {}", e->file->path(),
                  p.name, shape_text(e->tensor->shape), shape_text(p.shape));
      if (!st_dtype_is_float_readable(e->tensor->dtype))
        fail_user("{}: tensor {} has dtype {}; qtrain reads BF16, F16 and F32 weights",
                  e->file->path(), p.name, st_dtype_name(e->tensor->dtype));
    }
    for (const auto& [name, e] : w->tensors()) {
      if (name == "lm_head.weight" && tied_embeddings) continue;  // tied: ignored (below)
      bool known = false;
      for (const ParamInfo& p : layout.params()) known = known || p.name == name;
      if (!known) unexpected.push_back(name);
    }
    if (!missing.empty())
      fail_user("{}: {} tensor{} of the model {} missing: {}", dir, missing.size(),
                missing.size() == 1 ? "" : "s", missing.size() == 1 ? "is" : "are",
                name_list(missing));
    if (!unexpected.empty())
      fail_user("{}: {} unexpected tensor{} that a Qwen3 model of this config.json does not have: "
                "{}", dir, unexpected.size(), unexpected.size() == 1 ? "" : "s", name_list(unexpected));
    line = fmt::format("{} ({})", dir, w->describe());
  } catch (const UserError& e) {
    err = e.what();
  }
  agree(world, err);

  // 2. Read the rows this rank needs; refuse non-finite weights.
  try {
    for (const RowSlice& s : slices) {
      w->read_rows(s.param->name, s.row_begin, s.row_end, s.dst);
      const std::size_t n = static_cast<std::size_t>(s.row_end - s.row_begin) *
                            (s.param->numel / static_cast<std::size_t>(s.param->shape[0]));
      for (std::size_t i = 0; i < n; ++i)
        if (!std::isfinite(s.dst[i]))
          fail_user("{}: tensor {} holds a non-finite value ({}) at element {}", dir,
                    s.param->name, s.dst[i],
                    static_cast<std::size_t>(s.row_begin) * (s.param->numel / s.param->shape[0]) + i);
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
