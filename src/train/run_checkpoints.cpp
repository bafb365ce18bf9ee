#include "train/run_checkpoints.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "qtrain/error.h"

namespace qt {

namespace fs = std::filesystem;

namespace {

// Whether checkpoint file `path` lies directly in directory `dir` (by file identity).
bool lies_in(const std::string& path, const std::string& dir) {
  fs::path parent = fs::path(path).parent_path();
  if (parent.empty()) parent = ".";
  std::error_code ec;
  return fs::equivalent(parent, dir, ec) && !ec;
}

bool same_file(const std::string& a, const std::string& b) {
  std::error_code ec;
  return a == b || (fs::equivalent(a, b, ec) && !ec);
}

// "step_00000004.h5 .. step_00000009.h5" or the one name.
std::string name_range(const std::vector<std::string>& newest_first) {
  const std::string hi = fs::path(newest_first.front()).filename().string();
  const std::string lo = fs::path(newest_first.back()).filename().string();
  return newest_first.size() == 1 ? hi : fmt::format("{} .. {}", lo, hi);
}

}  // namespace

RunCheckpoints::RunCheckpoints(const Deck& deck, Mesh& mesh)
    : deck_(deck), mesh_(mesh), saving_(deck.checkpoint.every >= 0) {
  if (saving_) lock_ = std::make_unique<DirLock>(deck.checkpoint.dir, "checkpoint.dir", mesh.world());
}

bool RunCheckpoints::resume(const ParamLayout& layout, const StateTargets& targets,
                            TrainState& state, const LoraCheckpointInfo* lora) {
  const bool root = mesh_.world_rank() == 0;
  const std::string& dir = deck_.checkpoint.dir;
  const std::string& mode = deck_.checkpoint.resume;
  const std::vector<std::string> existing = checkpoint_list(dir, mesh_.world());  // newest first

  if (mode == "none") {
    if (saving_ && !existing.empty())
      fail_user(
          "checkpoint.dir = {} already holds {} checkpoint(s) ({}); checkpoint.resume = none "
          "starts a new run, which would overwrite them and mix its checkpoints with them: set "
          "checkpoint.dir to an empty or new directory, set checkpoint.resume = auto to continue "
          "from them, or move them away",
          dir, existing.size(), name_range(existing));
    return false;
  }

  std::string from;
  if (mode != "auto") {
    state = checkpoint_read(mode, mesh_, layout, targets, deck_.model, lora);
    from = mode;
    std::vector<std::string> newer;
    for (const std::string& p : existing)
      if (checkpoint_step(p) > state.step) newer.push_back(p);
    if (saving_ && !newer.empty())
      fail_user(
          "checkpoint.dir = {} holds {} checkpoint(s) newer than step {} of checkpoint.resume = "
          "{} ({}); continuing from step {} would overwrite them: move them away or set "
          "checkpoint.dir to another directory",
          dir, newer.size(), state.step, mode, name_range(newer), state.step);
  } else {
    for (const std::string& path : existing) {
      try {
        state = checkpoint_read(path, mesh_, layout, targets, deck_.model, lora);
        from = path;
        break;
      } catch (const CheckpointMismatch& e) {
        throw CheckpointMismatch(fmt::format(
            "{}. checkpoint.resume = auto does not skip a complete checkpoint of another run: "
            "this run would overwrite it. Resume it with the settings it was written with, or "
            "set checkpoint.dir to another directory",
            e.what()));
      } catch (const UserError& e) {
        if (root)
          std::fprintf(stderr,
                       "qtrain: warning: skipping unreadable checkpoint (kept: this run does not "
                       "delete or overwrite it): %s\n",
                       e.what());
      }
    }
    if (from.empty()) return false;
  }
  if (root) std::printf("resumed from %s at step %lld\n", from.c_str(), static_cast<long long>(state.step));
  newest_ = from;
  // The resumed checkpoint and the older ones beside it belong to this run's past: prunable.
  if (lies_in(from, dir)) {
    const std::int64_t from_step = checkpoint_step(from);
    for (const std::string& p : existing)
      if (same_file(p, from) || (from_step >= 0 && checkpoint_step(p) < from_step))
        prunable_.push_back(p);
  }
  return true;
}

std::string RunCheckpoints::save(const ParamLayout& layout, const std::vector<StatePiece>& pieces,
                                 const TrainState& state,
                                 const ModelConfig& model, const std::string& deck_text,
                                 const LoraCheckpointInfo* lora) {
  QT_CHECK(saving_, "save() of a run without checkpoints (checkpoint.every = -1)");
  const std::string path = checkpoint_path(deck_.checkpoint.dir, state.step);
  move_aside_foreign(path);
  checkpoint_write(path, mesh_, layout, pieces, state, model, deck_text, lora);
  prunable_.push_back(path);
  newest_ = path;
  prune();
  return path;
}

// A run writes each step once, after the step it resumed from, and resume refused every valid
// checkpoint in that range: a file where its next checkpoint goes is one that resume skipped as
// unreadable. Rank 0 renames it to "<name>.unreadable[.N]" instead of overwriting it.
void RunCheckpoints::move_aside_foreign(const std::string& path) {
  std::string err;
  if (mesh_.world_rank() == 0) {
    std::error_code ec;
    if (fs::exists(path, ec)) {
      std::string aside = path + ".unreadable";
      for (int n = 1; fs::exists(aside, ec); ++n) aside = fmt::format("{}.unreadable.{}", path, n);
      fs::rename(path, aside, ec);
      if (ec)
        err = fmt::format("cannot move the unreadable checkpoint {} out of the way of this run's "
                          "checkpoint: {}",
                          path, ec.message());
      else
        std::printf("moved the unreadable checkpoint %s aside to %s (kept)\n", path.c_str(),
                    aside.c_str());
    }
  }
  agree(mesh_.world(), err);
}

// Rank 0 deletes all but the newest checkpoint.keep of the prunable checkpoints, and the *.tmp
// files of interrupted writes (the lock guarantees that no other run is writing them).
void RunCheckpoints::prune() {
  if (mesh_.world_rank() == 0) {
    std::sort(prunable_.begin(), prunable_.end(), [](const std::string& a, const std::string& b) {
      return checkpoint_step(a) > checkpoint_step(b);
    });
    prunable_.erase(std::unique(prunable_.begin(), prunable_.end()), prunable_.end());
    std::error_code ec;
    const std::size_t keep = static_cast<std::size_t>(std::max(deck_.checkpoint.keep, 1));
    for (std::size_t i = keep; i < prunable_.size(); ++i) fs::remove(prunable_[i], ec);
    if (prunable_.size() > keep) prunable_.resize(keep);
    std::vector<fs::path> stale;
    for (fs::directory_iterator it(deck_.checkpoint.dir, ec), end; !ec && it != end;
         it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (name.size() > 4 && name.ends_with(".tmp") &&
          checkpoint_step(name.substr(0, name.size() - 4)) >= 0)
        stale.push_back(it->path());
    }
    for (const fs::path& p : stale) fs::remove(p, ec);
  }
  mesh_.world().barrier();
}

}  // namespace qt
