// Checkpoints in one parallel-HDF5 file (layout and rules: include/qtrain/checkpoint.h,
// docs/checkpoints.md).
//
// Write: every rank writes its pieces of the flat params and moments (over all ranks a partition
// of [0, numel)), collectively. Read: every rank reads P_r of every tensor (independent
// transfers, so that one rank's read error cannot hang the others), checksums it, and after the
// checksums agree the parts are redistributed over MPI to what each rank needs. Every error of
// the read path is agreed on by all ranks before it is thrown (agree()).
#include "qtrain/checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <regex>

#include "config/field_text.h"
#include "io/hdf5_util.h"
#include "io/parallel_file.h"
#include "io/redistribute.h"
#include "qtrain/error.h"
#include "runtime/memory.h"
#include "runtime/rng.h"

namespace qt {

namespace fs = std::filesystem;

namespace {

constexpr const char* kFormat = "qtrain-checkpoint";
constexpr std::int64_t kFormatVersion = 1;
// The three tensor groups, in the order of the flat buffers: params, exp_avg, exp_avg_sq.
constexpr const char* kGroups[3] = {"params", "optim/exp_avg", "optim/exp_avg_sq"};

// Checksum term of element i (flat index within its tensor) with float bit pattern b.
inline std::uint64_t checksum_term(std::uint64_t i, std::uint32_t b) {
  return rng::mix((i * 0x9E3779B97F4A7C15ull) ^ b);
}

// Sum (mod 2^64) of the terms of x[0, n), whose first element has tensor index `first`.
std::uint64_t checksum_part(const float* x, std::size_t n, std::uint64_t first) {
  std::uint64_t s = 0;
  for (std::size_t k = 0; k < n; ++k) {
    std::uint32_t b;
    std::memcpy(&b, x + k, sizeof b);
    s += checksum_term(first + k, b);
  }
  return s;
}

Range intersect(Range a, Range b) {
  Range r{std::max(a.begin, b.begin), std::min(a.end, b.end)};
  if (r.end < r.begin) r.end = r.begin;
  return r;
}

Range tensor_range(const ParamInfo& p) { return Range{p.offset, p.offset + p.numel}; }

std::vector<hsize_t> dims_of(const ParamInfo& p) {
  return std::vector<hsize_t>(p.shape.begin(), p.shape.end());
}

std::string shape_text(const std::vector<hsize_t>& d) {
  return fmt::format("[{}]", fmt::join(d, ", "));
}

// The model config fields stored as root attributes and compared on read.
struct ModelField {
  const char* name;
  bool integer;
  std::int64_t i;
  double d;
};

// A Qwen3-MoE model adds its architecture (router_aux_loss_coef, an objective setting, may
// change between runs); mlp_only_layers is a string attribute beside them ("1, 5", as decks
// write it: format_comma_list).
std::vector<ModelField> model_fields(const ModelConfig& m) {
  std::vector<ModelField> f = {{"vocab_size", true, m.vocab_size, 0},
          {"hidden_size", true, m.hidden_size, 0},
          {"intermediate_size", true, m.intermediate_size, 0},
          {"num_layers", true, m.num_layers, 0},
          {"num_heads", true, m.num_heads, 0},
          {"num_kv_heads", true, m.num_kv_heads, 0},
          {"head_dim", true, m.head_dim, 0},
          {"rope_theta", false, 0, m.rope_theta},
          {"rms_norm_eps", false, 0, m.rms_norm_eps},
          {"tie_word_embeddings", true, m.tie_word_embeddings ? 1 : 0, 0}};
  if (m.is_moe())
    f.insert(f.end(), {{"num_experts", true, m.num_experts, 0},
                       {"num_experts_per_tok", true, m.num_experts_per_tok, 0},
                       {"moe_intermediate_size", true, m.moe_intermediate_size, 0},
                       {"norm_topk_prob", true, m.norm_topk_prob ? 1 : 0, 0},
                       {"decoder_sparse_step", true, m.decoder_sparse_step, 0}});
  if (m.is_yarn())  // beside the string attribute rope_type
    f.insert(f.end(), {{"rope_factor", false, 0, m.rope_factor},
                       {"rope_original_max_position_embeddings", true,
                        m.rope_original_max_position_embeddings, 0},
                       {"rope_attention_factor", false, 0, m.rope_attention_factor},
                       {"rope_beta_fast", false, 0, m.rope_beta_fast},
                       {"rope_beta_slow", false, 0, m.rope_beta_slow}});
  return f;
}

// Rank 0 creates the checkpoint's directory and checks that its file system has `bytes` free;
// every rank throws alike when it cannot.
void prepare_directory(const std::string& path, double bytes, Comm& world) {
  std::string err;
  if (world.rank() == 0) {
    fs::path dir = fs::path(path).parent_path();
    if (dir.empty()) dir = ".";
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) {
      err = fmt::format("cannot create checkpoint directory {}: {}", dir.string(), ec.message());
    } else if (::access(dir.c_str(), W_OK | X_OK) != 0) {
      err = fmt::format("checkpoint directory {} is not writable", dir.string());
    } else if (const fs::space_info sp = fs::space(dir, ec);
               !ec && static_cast<double>(sp.available) < bytes) {
      err = fmt::format(
          "cannot write checkpoint {}: the file system of {} is full ({} free, the checkpoint "
          "needs about {}); nothing was written and the earlier checkpoints are kept: free space "
          "or set checkpoint.dir elsewhere",
          path, dir.string(), format_bytes(static_cast<double>(sp.available)), format_bytes(bytes));
    }
  }
  agree(world, err);
}

void fsync_path(const std::string& p, int flags) {
  const int fd = ::open(p.c_str(), flags);
  if (fd < 0) return;  // best effort: durability, not correctness
  ::fsync(fd);
  ::close(fd);
}

// The message of a failed write (`what`: what failed and why, from h5::write_pieces; `os`: its
// errno or 0), with the free space where the disk is full.
std::string write_failure(const std::string& path, const std::string& what, int os, double bytes) {
  fs::path dir = fs::path(path).parent_path();
  if (dir.empty()) dir = ".";
  std::error_code ec;
  const fs::space_info sp = fs::space(dir, ec);
  std::string why;
  if (os == ENOSPC && !ec)
    why = fmt::format("; {} free on the file system of {}, a checkpoint needs about {}",
                      format_bytes(static_cast<double>(sp.available)), dir.string(),
                      format_bytes(bytes));
  else if (os == EFBIG)
    why = "; the file size limit (ulimit -f) was reached";
  return fmt::format(
      "cannot write checkpoint {}: {}{}. The partial file was removed; the earlier checkpoints "
      "are kept",
      path, what, why);
}

// The dataset of sparse layer l's router bias (TrainState::router_bias).
std::string router_bias_name(int l) {
  return fmt::format("model.layers.{}.mlp.gate.expert_bias", l);
}

// Writes the state's router bias, [E] a sparse layer, as compact datasets (the values inside the
// metadata, which rank 0 writes alone: no offsets in the data region). Nothing without one.
void write_router_bias(hid_t file, const ModelConfig& model, const std::vector<float>& bias) {
  using namespace h5;
  if (bias.empty()) return;
  const int E = model.num_experts, layers = model.num_moe_layers();
  QT_CHECK(bias.size() == static_cast<std::size_t>(layers) * E,
           "router bias of {} values for {} sparse layers of {} experts", bias.size(), layers, E);
  Handle grp = QT_H5_OPEN(H5Gcreate2(file, "router_bias", H5P_DEFAULT, untimed_gcpl(), H5P_DEFAULT),
                          close_group);
  Handle dcpl = QT_H5_OPEN(H5Pcreate(H5P_DATASET_CREATE), close_plist);
  QT_CHECK_HDF5(H5Pset_layout(dcpl, H5D_COMPACT));
  QT_CHECK_HDF5(H5Pset_obj_track_times(dcpl, 0));
  const hsize_t dims = static_cast<hsize_t>(E);
  Handle space = QT_H5_OPEN(H5Screate_simple(1, &dims, nullptr), close_space);
  for (int l = 0; l < model.num_layers; ++l) {
    if (!model.is_moe_layer(l)) continue;
    Handle ds = QT_H5_OPEN(H5Dcreate2(grp, router_bias_name(l).c_str(), H5T_IEEE_F32LE, space,
                                      H5P_DEFAULT, dcpl, H5P_DEFAULT),
                           close_dataset);
    const float* row = bias.data() + static_cast<std::size_t>(model.moe_layers_before(l)) * E;
    QT_CHECK_HDF5(H5Dwrite(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, row));
  }
}

// Reads /router_bias into `bias` ([sparse layers, E]; left empty when the file has none);
// returns an error text or "".
std::string read_router_bias(hid_t file, const std::string& path, const ModelConfig& model,
                             std::vector<float>& bias) {
  h5::QuietErrors quiet;
  bias.clear();
  if (!model.is_moe() || H5Lexists(file, "/router_bias", H5P_DEFAULT) <= 0) return {};
  const int E = model.num_experts;
  std::vector<float> out(static_cast<std::size_t>(model.num_moe_layers()) * E);
  for (int l = 0; l < model.num_layers; ++l) {
    if (!model.is_moe_layer(l)) continue;
    const std::string where = "/router_bias/" + router_bias_name(l);
    if (H5Lexists(file, where.c_str(), H5P_DEFAULT) <= 0)
      return fmt::format("checkpoint {}: {} is missing", path, where);
    h5::Handle ds(H5Dopen2(file, where.c_str(), H5P_DEFAULT), h5::close_dataset);
    const auto dims = ds.valid() ? h5::dataset_dims(ds) : std::nullopt;
    if (!dims || *dims != std::vector<hsize_t>{static_cast<hsize_t>(E)})
      return fmt::format("checkpoint {}: {} is not an array of the model's {} experts", path,
                         where, E);
    float* row = out.data() + static_cast<std::size_t>(model.moe_layers_before(l)) * E;
    if (H5Dread(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, row) < 0)
      return fmt::format("checkpoint {}: cannot read {} ({})", path, where, h5::last_error());
  }
  for (float b : out)
    if (!std::isfinite(b)) return fmt::format("checkpoint {}: /router_bias holds {}", path, b);
  bias = std::move(out);
  return {};
}

// Writes the checkpoint's metadata (root attributes, groups, every dataset with its checksum) into
// the in-memory `file` of h5::metadata_image; offsets[g * nt + t] gets where the values of tensor
// t of group g go. Returns the smallest offset.
std::uint64_t write_metadata(hid_t file, const ParamLayout& layout, const TrainState& state,
                             const ModelConfig& model, const std::string& deck_text,
                             const LoraCheckpointInfo* lora, const std::uint64_t* sums,
                             std::vector<std::uint64_t>& offsets) {
  using namespace h5;
  // Attributes first: their strings go to a heap placed like data, before the datasets.
  write_attr_string(file, "format", kFormat);
  write_attr_i64(file, "format_version", kFormatVersion);
  write_attr_i64(file, "step", state.step);
  write_attr_i64(file, "samples_consumed", state.samples_consumed);
  write_attr_i64(file, "tokens_consumed", state.tokens_consumed);
  write_attr_u64(file, "seed", state.seed);
  write_attr_u64(file, "rng_counter", state.rng_counter);
  write_attr_i64(file, "skipped_steps", state.skipped_steps);
  if (state.loss_scale > 0) {  // train.precision = fp16
    write_attr_f64(file, "loss_scale", state.loss_scale);
    write_attr_i64(file, "loss_scale_hysteresis", state.loss_scale_hysteresis);
    write_attr_i64(file, "loss_scale_clean_steps", state.loss_scale_clean_steps);
    write_attr_i64(file, "overflow_steps", state.overflow_steps);
  }
  write_attr_string(file, "deck", deck_text);
  write_attr_string(file, "preset", model.preset);
  for (const ModelField& f : model_fields(model)) {
    if (f.integer)
      write_attr_i64(file, f.name, f.i);
    else
      write_attr_f64(file, f.name, f.d);
  }
  if (model.is_moe())
    write_attr_string(file, "mlp_only_layers", format_comma_list(model.mlp_only_layers));
  if (model.is_yarn()) write_attr_string(file, "rope_type", model.rope_type);
  if (lora) {
    write_attr_i64(file, "lora_r", lora->config.r);
    write_attr_f64(file, "lora_alpha", lora->config.alpha);
    write_attr_f64(file, "lora_dropout", lora->config.dropout);
    write_attr_string(file, "lora_targets", lora->config.targets);
    write_attr_string(file, "lora_base_init", lora->base.init);
    write_attr_string(file, "lora_base_init_abs", lora->base.init_abs);
    write_attr_u64(file, "lora_base_seed", lora->base.seed);
  }
  // Before the tensors' datasets, whose early allocation would otherwise come first.
  write_router_bias(file, model, state.router_bias);
  const Handle gcpl = untimed_gcpl();
  for (const char* gname : {"params", "optim", "optim/exp_avg", "optim/exp_avg_sq"}) {
    Handle grp = QT_H5_OPEN(H5Gcreate2(file, gname, H5P_DEFAULT, gcpl, H5P_DEFAULT), close_group);
  }
  const auto& ps = layout.params();
  const std::size_t nt = ps.size();
  Handle dcpl = early_contiguous_dcpl();
  std::uint64_t first = UINT64_MAX;
  for (int g = 0; g < 3; ++g) {
    Handle grp = QT_H5_OPEN(H5Gopen2(file, kGroups[g], H5P_DEFAULT), close_group);
    for (std::size_t t = 0; t < nt; ++t) {
      const std::vector<hsize_t> dims = dims_of(ps[t]);
      Handle space = QT_H5_OPEN(
          H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr), close_space);
      Handle ds = QT_H5_OPEN(H5Dcreate2(grp, ps[t].name.c_str(), H5T_IEEE_F32LE, space,
                                        H5P_DEFAULT, dcpl, H5P_DEFAULT),
                             close_dataset);
      write_attr_u64(ds, "checksum", sums[g * nt + t]);
      offsets[g * nt + t] = dataset_offset(ds);
      first = std::min(first, offsets[g * nt + t]);
    }
  }
  return first;
}

}  // namespace

std::string checkpoint_path(const std::string& dir, std::int64_t step) {
  return (fs::path(dir) / fmt::format("step_{:08d}.h5", step)).string();
}

std::int64_t checkpoint_step(const std::string& path) {
  static const std::regex name_re(R"(step_([0-9]{8,18})\.h5)");
  std::smatch m;
  const std::string name = fs::path(path).filename().string();
  if (!std::regex_match(name, m, name_re)) return -1;
  return std::stoll(m[1].str());
}

std::vector<StatePiece> flat_state_pieces(std::size_t numel, const Comm& world, const float* params,
                                          const MomentShard& moments) {
  const Range part = split_range(numel, world.size(), world.rank());
  if (part.size() == 0) return {};
  QT_CHECK(moments.range.begin <= part.begin && part.end <= moments.range.end,
           "write partition [{}, {}) is not inside the moment shard [{}, {})", part.begin, part.end,
           moments.range.begin, moments.range.end);
  const std::size_t m = part.begin - moments.range.begin;
  return {StatePiece{part, params + part.begin, moments.exp_avg + m, moments.exp_avg_sq + m}};
}

StateTargets flat_state_targets(std::size_t numel, float* params, const MomentShard& moments) {
  QT_CHECK(moments.range.begin <= moments.range.end && moments.range.end <= numel,
           "moment range [{}, {}) outside the {} parameters", moments.range.begin,
           moments.range.end, numel);
  return {{FlatPiece{Range{0, numel}, params}},
          {FlatPiece{moments.range, moments.exp_avg}},
          {FlatPiece{moments.range, moments.exp_avg_sq}}};
}

void checkpoint_write(const std::string& path, Mesh& mesh, const ParamLayout& layout,
                      const float* params, const MomentShard& moments, const TrainState& state,
                      const ModelConfig& model, const std::string& deck_text,
                      const LoraCheckpointInfo* lora) {
  checkpoint_write(path, mesh, layout,
                   flat_state_pieces(layout.numel(), mesh.world(), params, moments), state, model,
                   deck_text, lora);
}

void checkpoint_write(const std::string& path, Mesh& mesh, const ParamLayout& layout,
                      const std::vector<StatePiece>& pieces, const TrainState& state,
                      const ModelConfig& model, const std::string& deck_text,
                      const LoraCheckpointInfo* lora) {
  MpiComm& world = mesh.world();
  const std::size_t numel = layout.numel();
  std::vector<Range> ranges;
  for (const StatePiece& p : pieces) {
    QT_CHECK(p.range.begin <= p.range.end && p.range.end <= numel,
             "checkpoint {}: piece [{}, {}) outside the {} elements of the state", path,
             p.range.begin, p.range.end, numel);
    QT_CHECK(p.range.size() == 0 || (p.params && p.exp_avg && p.exp_avg_sq),
             "checkpoint {}: piece [{}, {}) lacks its params or a moment", path, p.range.begin,
             p.range.end);
    ranges.push_back(p.range);
  }
  // The same verdict on every rank (all see every rank's ranges), before anything is written.
  const std::string cover = partition_error(all_gather_ranges(world, ranges), numel);
  QT_CHECK(cover.empty(),
           "checkpoint {}: the pieces of all ranks must cover the {} elements of the state exactly "
           "once: {}; nothing was written",
           path, numel, cover);
  // This rank's pieces in flat order (the order of the file's values within a group).
  std::vector<const StatePiece*> mine;
  for (const StatePiece& p : pieces)
    if (p.range.size() > 0) mine.push_back(&p);
  std::sort(mine.begin(), mine.end(), [](const StatePiece* a, const StatePiece* b) {
    return a->range.begin < b->range.begin;
  });
  const auto& ps = layout.params();
  const std::size_t nt = ps.size();
  // Calls f(g, t, r, x) for every group g, piece and tensor t it meets: r = piece ∩ tensor t,
  // x = the values of r in group g.
  auto for_each_part = [&](auto&& f) {
    for (int g = 0; g < 3; ++g)
      for (const StatePiece* p : mine) {
        const float* src = g == 0 ? p->params : g == 1 ? p->exp_avg : p->exp_avg_sq;
        std::size_t t =
            std::upper_bound(ps.begin(), ps.end(), p->range.begin,
                             [](std::size_t x, const ParamInfo& q) { return x < q.offset; }) -
            ps.begin() - 1;
        for (; t < nt && ps[t].offset < p->range.end; ++t) {
          const Range r = intersect(p->range, tensor_range(ps[t]));
          if (r.size() > 0) f(g, t, r, src + (r.begin - p->range.begin));
        }
      }
  };

  // Checksums and non-finite counts of this rank's parts of every tensor, summed over ranks.
  std::vector<std::uint64_t> counts(6 * nt, 0);  // [sums (3 nt), non-finite (3 nt)]
  for_each_part([&](int g, std::size_t t, Range r, const float* x) {
    counts[g * nt + t] += checksum_part(x, r.size(), r.begin - ps[t].offset);
    std::uint64_t bad = 0;
    for (std::size_t k = 0; k < r.size(); ++k) bad += !std::isfinite(x[k]);
    counts[(3 + g) * nt + t] += bad;
  });
  world.all_reduce(counts.data(), counts.size(), DType::kU64, ReduceOp::kSum);
  for (int g = 0; g < 3; ++g)
    for (std::size_t t = 0; t < nt; ++t)
      if (const std::uint64_t bad = counts[(3 + g) * nt + t]; bad > 0)
        throw NonFiniteState(fmt::format(
            "not writing checkpoint {}: /{}/{} holds {} non-finite value(s) (NaN or infinity) "
            "at step {}",
            path, kGroups[g], ps[t].name, bad, state.step));

  // The datasets' bytes, plus room for the metadata and the deck.
  const double bytes = 3.0 * 4.0 * static_cast<double>(layout.numel()) + 4096.0 * 3 * nt +
                       static_cast<double>(deck_text.size()) + 1024.0 * 1024;
  prepare_directory(path, bytes, world);

  // Rank 0 builds the metadata in memory; every rank learns where each tensor's values go and
  // writes its part of them (one piece per tensor part, merged where adjacent in the file).
  std::string image;
  std::vector<std::uint64_t> offsets(3 * nt, 0);
  if (world.rank() == 0)
    image = h5::metadata_image([&](hid_t file) {
      return write_metadata(file, layout, state, model, deck_text, lora, counts.data(), offsets);
    });
  world.broadcast(offsets.data(), offsets.size(), DType::kU64, 0);
  std::vector<h5::Piece> writes;
  if (!image.empty()) writes.push_back({0, image.data(), image.size()});
  for_each_part([&](int g, std::size_t t, Range r, const float* x) {
    const h5::Piece p{offsets[g * nt + t] + 4 * (r.begin - ps[t].offset), x, 4 * r.size()};
    h5::Piece* last = writes.empty() ? nullptr : &writes.back();
    if (last && last->at + last->bytes == p.at &&
        static_cast<const char*>(last->data) + last->bytes == p.data)
      last->bytes += p.bytes;
    else
      writes.push_back(p);
  });

  // A .tmp of an interrupted write is replaced (the writes do not truncate).
  const std::string tmp = path + ".tmp";
  std::error_code ec;
  if (world.rank() == 0) fs::remove(tmp, ec);
  world.barrier();
  const h5::WriteResult w = h5::write_pieces(tmp, writes, world);
  if (!w.ok()) {
    if (world.rank() == 0) fs::remove(tmp, ec);
    world.barrier();
    fail_user("{}", write_failure(path, w.error, w.os_error, bytes));
  }
  std::string err;
  if (world.rank() == 0) {
    fsync_path(tmp, O_RDONLY);
    fs::rename(tmp, path, ec);  // atomic replace: readers see the old file or the complete new one
    if (ec) {
      err = fmt::format("cannot rename {} to {}: {}; the earlier checkpoints are kept", tmp, path,
                        ec.message());
      fs::remove(tmp, ec);
    }
    fs::path dir = fs::path(path).parent_path();
    fsync_path(dir.empty() ? std::string(".") : dir.string(), O_RDONLY | O_DIRECTORY);
  }
  agree(world, err);
}

namespace {

// A LoRA checkpoint must be read as one, with the same r, alpha, targets and base; returns an
// error text or "", and sets `mismatch` when the error is a difference from the deck (not damage).
std::string check_lora(hid_t file, const std::string& path, const LoraCheckpointInfo* want,
                       bool& mismatch) {
  mismatch = true;
  const auto r = h5::try_read_attr_i64(file, "lora_r");
  if (!want && r)
    return fmt::format(
        "checkpoint {} holds LoRA adapters (lora.r = {}), not the whole model: resume it with the "
        "[lora] section of its run, or `qtrain export` it",
        path, *r);
  if (!want) return {};
  if (!r)
    return fmt::format(
        "checkpoint {} holds the whole model, not LoRA adapters, so a LoRA run (lora.r = {}) "
        "cannot resume it; to adapt its weights, `qtrain export` it and start from model.init",
        path, want->config.r);
  LoraCheckpointInfo have;
  have.config.r = static_cast<int>(*r);
  const auto alpha = h5::try_read_attr_f64(file, "lora_alpha");
  const auto dropout = h5::try_read_attr_f64(file, "lora_dropout");
  const auto targets = h5::try_read_attr_string(file, "lora_targets");
  const auto init = h5::try_read_attr_string(file, "lora_base_init");
  const auto seed = h5::try_read_attr_u64(file, "lora_base_seed");
  if (!alpha || !dropout || !targets || !init || !seed) {
    mismatch = false;
    return fmt::format("checkpoint {}: a LoRA root attribute (lora_alpha, lora_dropout, "
                       "lora_targets, lora_base_init, lora_base_seed) is missing",
                       path);
  }
  have.base = {*init, *seed, h5::try_read_attr_string(file, "lora_base_init_abs").value_or("")};
  const std::string differs = "checkpoint {} does not match the deck's [lora]: {} is {} in the "
                               "checkpoint but {} in the deck";
  if (have.config.r != want->config.r)
    return fmt::format(fmt::runtime(differs), path, "lora.r", have.config.r, want->config.r);
  if (*alpha != want->config.alpha)
    return fmt::format(fmt::runtime(differs), path, "lora.alpha", *alpha, want->config.alpha);
  try {
    if (parse_lora_targets(*targets, "lora_targets") !=
        parse_lora_targets(want->config.targets, "lora.targets"))
      return fmt::format(fmt::runtime(differs), path, "lora.targets", *targets,
                         want->config.targets);
  } catch (const UserError& e) {
    mismatch = false;  // unreadable targets: damage
    return fmt::format("checkpoint {}: {}", path, e.what());
  }
  if (!have.base.same_as(want->base))
    return fmt::format("checkpoint {}: its LoRA adapters were trained on the base {}, but this "
                       "run's base is {}",
                       path, have.base.describe(), want->base.describe());
  return {};
}

// Reads and checks the root attributes; returns an error text or "" and fills `st`. Sets
// `mismatch` when the error is a difference from the deck (format version, model), not damage.
std::string read_root(hid_t file, const std::string& path, const ModelConfig& model,
                      TrainState& st, bool& mismatch) {
  mismatch = false;
  auto format = h5::try_read_attr_string(file, "format");
  if (!format || *format != kFormat)
    return fmt::format(
        "{} is not a qtrain checkpoint (root attribute format is {}, expected \"{}\")", path,
        format ? fmt::format("\"{}\"", *format) : std::string("missing"), kFormat);
  auto version = h5::try_read_attr_i64(file, "format_version");
  mismatch = version && *version != kFormatVersion;
  if (!version || *version != kFormatVersion)
    return fmt::format("checkpoint {}: format_version is {}, this qtrain reads version {}", path,
                       version ? std::to_string(*version) : std::string("missing"), kFormatVersion);
  // A dense checkpoint has no num_experts attribute (and was written before MoE existed).
  const std::int64_t experts = h5::try_read_attr_i64(file, "num_experts").value_or(0);
  if (experts != model.num_experts) {
    mismatch = true;
    return fmt::format("checkpoint {} does not match the deck's model: model.num_experts is {} in "
                       "the checkpoint but {} in the deck",
                       path, experts, model.num_experts);
  }
  // RoPE scaling: a checkpoint of plain RoPE (or from before YaRN) has no rope_type.
  const std::string rope = h5::try_read_attr_string(file, "rope_type").value_or("default");
  if (rope != model.rope_type) {
    mismatch = true;
    return fmt::format("checkpoint {} does not match the deck's model: model.rope_type is {} in "
                       "the checkpoint but {} in the deck",
                       path, rope, model.rope_type);
  }
  if (model.is_moe()) {
    const std::string layers = h5::try_read_attr_string(file, "mlp_only_layers").value_or("?");
    const std::string want = format_comma_list(model.mlp_only_layers);
    if (layers != want) {
      mismatch = true;
      return fmt::format("checkpoint {} does not match the deck's model: model.mlp_only_layers "
                         "is '{}' in the checkpoint but '{}' in the deck",
                         path, layers, want);
    }
  }
  for (const ModelField& f : model_fields(model)) {
    std::string have, want;
    if (f.integer) {
      auto v = h5::try_read_attr_i64(file, f.name);
      if (!v) return fmt::format("checkpoint {}: root attribute {} is missing", path, f.name);
      if (*v == f.i) continue;
      const bool boolean = std::strcmp(f.name, "tie_word_embeddings") == 0 ||
                           std::strcmp(f.name, "norm_topk_prob") == 0;
      have = boolean ? (*v != 0 ? "true" : "false") : std::to_string(*v);
      want = boolean ? (f.i != 0 ? "true" : "false") : std::to_string(f.i);
    } else {
      auto v = h5::try_read_attr_f64(file, f.name);
      if (!v) return fmt::format("checkpoint {}: root attribute {} is missing", path, f.name);
      if (*v == f.d) continue;
      have = fmt::format("{}", *v);
      want = fmt::format("{}", f.d);
    }
    mismatch = true;
    return fmt::format(
        "checkpoint {} does not match the deck's model: model.{} is {} in the checkpoint but {} "
        "in the deck",
        path, f.name, have, want);
  }
  auto i64 = [&](const char* name, std::int64_t& out) {
    auto v = h5::try_read_attr_i64(file, name);
    if (v) out = *v;
    return v.has_value();
  };
  auto u64 = [&](const char* name, std::uint64_t& out) {
    auto v = h5::try_read_attr_u64(file, name);
    if (v) out = *v;
    return v.has_value();
  };
  if (!i64("step", st.step))
    return fmt::format("checkpoint {}: root attribute step is missing", path);
  if (!i64("samples_consumed", st.samples_consumed))
    return fmt::format("checkpoint {}: root attribute samples_consumed is missing", path);
  if (!i64("tokens_consumed", st.tokens_consumed))
    return fmt::format("checkpoint {}: root attribute tokens_consumed is missing", path);
  if (!u64("seed", st.seed))
    return fmt::format("checkpoint {}: root attribute seed is missing", path);
  if (!u64("rng_counter", st.rng_counter))
    return fmt::format("checkpoint {}: root attribute rng_counter is missing", path);
  if (!i64("skipped_steps", st.skipped_steps)) st.skipped_steps = 0;  // older checkpoints
  if (st.skipped_steps < 0 || st.skipped_steps > st.step)
    return fmt::format("checkpoint {}: root attribute skipped_steps = {} is outside [0, step = {}]",
                       path, st.skipped_steps, st.step);
  // An fp16 run's loss scaler: all four attributes or none.
  const auto scale = h5::try_read_attr_f64(file, "loss_scale");
  if (!scale) return {};
  st.loss_scale = *scale;
  if (!(st.loss_scale > 0) || !std::isfinite(st.loss_scale))
    return fmt::format("checkpoint {}: root attribute loss_scale = {} is not a finite number > 0",
                       path, st.loss_scale);
  for (const auto& [name, out] : {std::pair{"loss_scale_hysteresis", &st.loss_scale_hysteresis},
                                  std::pair{"loss_scale_clean_steps", &st.loss_scale_clean_steps},
                                  std::pair{"overflow_steps", &st.overflow_steps}})
    if (!i64(name, *out))
      return fmt::format("checkpoint {}: root attribute {} is missing (loss_scale is there)",
                         path, name);
  if (st.loss_scale_hysteresis < 1 || st.loss_scale_hysteresis > (1 << 30))
    return fmt::format("checkpoint {}: root attribute loss_scale_hysteresis = {} is outside "
                       "[1, 2^30]", path, st.loss_scale_hysteresis);
  if (st.loss_scale_clean_steps < 0 || st.loss_scale_clean_steps > st.step)
    return fmt::format("checkpoint {}: root attribute loss_scale_clean_steps = {} is outside "
                       "[0, step = {}]", path, st.loss_scale_clean_steps, st.step);
  if (st.overflow_steps < 0 || st.overflow_steps > st.skipped_steps)
    return fmt::format("checkpoint {}: root attribute overflow_steps = {} is outside "
                       "[0, skipped_steps = {}]", path, st.overflow_steps, st.skipped_steps);
  return {};
}

// Opens /<group>/<name> and checks type, shape and checksum attribute; returns an error text or "".
std::string open_tensor(hid_t file, const std::string& path, const char* group, const ParamInfo& p,
                        h5::Handle& ds, std::uint64_t& checksum) {
  const std::string where = fmt::format("/{}/{}", group, p.name);
  h5::QuietErrors quiet;
  // Check each link on the way: H5Lexists fails (rather than says no) past a missing group.
  std::string link;
  for (const std::string& comp : {std::string(group), p.name}) {
    for (std::size_t start = 0;;) {
      const std::size_t slash = comp.find('/', start);
      link.append(1, '/').append(comp, start,
                                 slash == std::string::npos ? std::string::npos : slash - start);
      if (H5Lexists(file, link.c_str(), H5P_DEFAULT) <= 0)
        return fmt::format("checkpoint {}: tensor {} is missing", path, where);
      if (slash == std::string::npos) break;
      start = slash + 1;
    }
  }
  ds = h5::Handle(H5Dopen2(file, where.c_str(), H5P_DEFAULT), h5::close_dataset);
  if (!ds.valid()) return fmt::format("checkpoint {}: {} is not a dataset", path, where);
  h5::Handle type(H5Dget_type(ds), h5::close_type);
  if (!type.valid() || H5Tget_class(type) != H5T_FLOAT || H5Tget_size(type) != 4)
    return fmt::format("checkpoint {}: tensor {} is not float32", path, where);
  const auto dims = h5::dataset_dims(ds);
  const auto want = dims_of(p);
  if (!dims || *dims != want)
    return fmt::format("checkpoint {}: tensor {} has shape {}, the model needs {}", path, where,
                       dims ? shape_text(*dims) : std::string("(not an array)"), shape_text(want));
  auto sum = h5::try_read_attr_u64(ds, "checksum");
  if (!sum) return fmt::format("checkpoint {}: tensor {} has no checksum attribute", path, where);
  checksum = *sum;
  return {};
}

}  // namespace

TrainState checkpoint_read(const std::string& path, Mesh& mesh, const ParamLayout& layout,
                           float* params, const MomentShard& moments, const ModelConfig& model,
                           const LoraCheckpointInfo* lora) {
  return checkpoint_read(path, mesh, layout, flat_state_targets(layout.numel(), params, moments),
                         model, lora);
}

TrainState checkpoint_read(const std::string& path, Mesh& mesh, const ParamLayout& layout,
                           const StateTargets& targets, const ModelConfig& model,
                           const LoraCheckpointInfo* lora) {
  MpiComm& world = mesh.world();
  const std::size_t numel = layout.numel();
  for (const auto* group : {&targets.params, &targets.exp_avg, &targets.exp_avg_sq})
    for (const FlatPiece& t : *group)
      QT_CHECK(t.range.begin <= t.range.end && t.range.end <= numel &&
                   (t.range.size() == 0 || t.data != nullptr),
               "checkpoint {}: target [{}, {}) is outside the {} elements of the state or has no "
               "buffer",
               path, t.range.begin, t.range.end, numel);
  h5::QuietErrors quiet;

  std::string err;
  if (world.rank() == 0) {
    std::error_code ec;
    if (!fs::exists(path, ec))
      err = fmt::format("checkpoint {}: no such file", path);
    else if (!fs::is_regular_file(path, ec))
      err = fmt::format("checkpoint {}: not a regular file", path);
  }
  agree(world, err);

  h5::Handle fapl = QT_H5_OPEN(H5Pcreate(H5P_FILE_ACCESS), h5::close_plist);
  QT_CHECK_HDF5(H5Pset_fapl_mpio(fapl, world.mpi(), MPI_INFO_NULL));
  h5::Handle file(H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl), h5::close_file);
  if (!file.valid())
    err = fmt::format(
        "checkpoint {}: cannot open it as HDF5 ({}): the file is truncated, "
        "corrupt or not a checkpoint",
        path, h5::last_error());
  agree(world, err);

  // Metadata: format, model, state, and every tensor with its shape and checksum.
  TrainState st;
  const auto& ps = layout.params();
  const std::size_t nt = ps.size();
  std::vector<h5::Handle> ds(3 * nt);
  std::vector<std::uint64_t> stored(3 * nt, 0);
  bool mismatch = false;
  err = read_root(file, path, model, st, mismatch);
  if (err.empty()) err = check_lora(file, path, lora, mismatch);
  // A difference from the deck is a CheckpointMismatch on every rank (all read the same file).
  std::int64_t any_mismatch = !err.empty() && mismatch;
  world.all_reduce(&any_mismatch, 1, DType::kI64, ReduceOp::kMax);
  if (any_mismatch) {
    try {
      agree(world, err);
    } catch (const UserError& e) {
      throw CheckpointMismatch(e.what());
    }
  }
  for (int g = 0; g < 3 && err.empty(); ++g)
    for (std::size_t t = 0; t < nt && err.empty(); ++t)
      err = open_tensor(file, path, kGroups[g], ps[t], ds[g * nt + t], stored[g * nt + t]);
  if (err.empty()) err = read_router_bias(file, path, model, st.router_bias);
  agree(world, err);

  // This rank's write partition of every tensor, and its checksum terms.
  const Range part = split_range(numel, world.size(), world.rank());
  std::vector<float> local[3];
  std::vector<std::uint64_t> sums(3 * nt, 0);
  h5::Handle dxpl = QT_H5_OPEN(H5Pcreate(H5P_DATASET_XFER), h5::close_plist);
  QT_CHECK_HDF5(H5Pset_dxpl_mpio(dxpl, H5FD_MPIO_INDEPENDENT));
  for (int g = 0; g < 3; ++g) {
    local[g].resize(part.size());
    for (std::size_t t = 0; t < nt && err.empty(); ++t) {
      const ParamInfo& p = ps[t];
      const Range r = intersect(part, tensor_range(p));
      if (r.size() == 0) continue;
      const auto dims = dims_of(p);
      const hsize_t n_mem = r.size();
      h5::Handle fspace(H5Dget_space(ds[g * nt + t]), h5::close_space);
      h5::Handle mspace(H5Screate_simple(1, &n_mem, nullptr), h5::close_space);
      float* dst = local[g].data() + (r.begin - part.begin);
      if (!fspace.valid() || !mspace.valid() ||
          h5::select_flat_range(fspace, dims, r.begin - p.offset, r.end - p.offset) < 0 ||
          H5Dread(ds[g * nt + t], H5T_NATIVE_FLOAT, mspace, fspace, dxpl, dst) < 0) {
        err = fmt::format("checkpoint {}: cannot read /{}/{} ({})", path, kGroups[g], p.name,
                          h5::last_error());
        break;
      }
      sums[g * nt + t] = checksum_part(dst, r.size(), r.begin - p.offset);
    }
  }
  agree(world, err);
  ds.clear();
  file.close();  // collective, reached by every rank

  world.all_reduce(sums.data(), sums.size(), DType::kU64, ReduceOp::kSum);
  for (int g = 0; g < 3; ++g) {
    for (std::size_t t = 0; t < nt; ++t) {
      if (sums[g * nt + t] == stored[g * nt + t]) continue;
      // Identical on every rank (all-reduced sums, same file): no agreement needed.
      fail_user(
          "checkpoint {}: checksum mismatch in tensor /{}/{} (stored {:#018x}, data gives "
          "{:#018x}): the file is corrupt",
          path, kGroups[g], ps[t].name, stored[g * nt + t], sums[g * nt + t]);
    }
  }

  const std::vector<FlatPiece>* to[3] = {&targets.params, &targets.exp_avg, &targets.exp_avg_sq};
  for (int g = 0; g < 3; ++g) {
    redistribute_pieces(world, numel, {ConstFlatPiece{part, local[g].data()}}, *to[g]);
    std::vector<float>().swap(local[g]);  // [part] no longer needed
  }
  return st;
}

std::vector<std::string> checkpoint_list(const std::string& dir, Comm& world) {
  std::string joined;  // newline-separated paths, newest first
  if (world.rank() == 0) {
    std::vector<std::pair<std::int64_t, std::string>> found;
    std::error_code ec;
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
      const std::int64_t step = checkpoint_step(it->path().string());
      if (step < 0 || !it->is_regular_file(ec)) continue;
      found.emplace_back(step, it->path().string());
    }
    std::sort(found.begin(), found.end(),
              [](const auto& a, const auto& b) { return a.first > b.first; });
    for (const auto& f : found) joined += f.second + "\n";
  }
  broadcast_string(world, joined, 0);
  std::vector<std::string> out;
  for (std::size_t start = 0, nl; (nl = joined.find('\n', start)) != std::string::npos;
       start = nl + 1)
    out.push_back(joined.substr(start, nl - start));
  return out;
}

}  // namespace qt
