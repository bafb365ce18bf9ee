// Numerical safety (issue 19, train.max_consecutive_skips), shared by the CPU test and the GPU
// test: gradients made NaN on chosen steps (QTRAIN_TEST_NONFINITE_STEPS, on one rank or all)
// must leave the checkpointed state exactly as it was, be counted, and stop the run when too many
// come in a row. The state is read straight from the checkpoints' HDF5 datasets.
#pragma once

#include <gtest/gtest.h>
#include <hdf5.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "train/training_harness.h"

namespace qt::test {

// Every dataset under /params and /optim of a checkpoint, by its path, as floats; empty when the
// file cannot be opened.
inline std::map<std::string, std::vector<float>> read_trained_state(const std::string& path) {
  std::map<std::string, std::vector<float>> out;
  const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (f < 0) return out;
  struct Visit {
    std::map<std::string, std::vector<float>>* out;
  } visit{&out};
  for (const char* group : {"/params", "/optim/exp_avg", "/optim/exp_avg_sq"}) {
    const hid_t g = H5Gopen2(f, group, H5P_DEFAULT);
    if (g < 0) continue;
    H5Literate(
        g, H5_INDEX_NAME, H5_ITER_INC, nullptr,
        [](hid_t gid, const char* name, const H5L_info_t*, void* data) -> herr_t {
          const hid_t ds = H5Dopen2(gid, name, H5P_DEFAULT);
          if (ds < 0) return 0;
          const hid_t space = H5Dget_space(ds);
          const hssize_t n = H5Sget_simple_extent_npoints(space);
          std::vector<float> v(static_cast<std::size_t>(n));
          char where[512];
          H5Iget_name(gid, where, sizeof where);
          if (H5Dread(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()) >= 0)
            (*static_cast<Visit*>(data)->out)[std::string(where) + "/" + name] = std::move(v);
          H5Sclose(space);
          H5Dclose(ds);
          return 0;
        },
        &visit);
    H5Gclose(g);
  }
  H5Fclose(f);
  return out;
}

// How many elements of two states differ (bit for bit as floats; NaN never equals), and whether
// they hold the same tensors; -1 when not.
inline long long differing_elements(const std::map<std::string, std::vector<float>>& a,
                                    const std::map<std::string, std::vector<float>>& b) {
  if (a.size() != b.size() || a.empty()) return -1;
  long long diff = 0;
  for (const auto& [name, x] : a) {
    const auto it = b.find(name);
    if (it == b.end() || it->second.size() != x.size()) return -1;
    for (std::size_t i = 0; i < x.size(); ++i) diff += !(x[i] == it->second[i]);
  }
  return diff;
}

inline std::string step_file(const std::string& dir, int step) {
  char name[32];
  std::snprintf(name, sizeof name, "/step_%08d.h5", step);
  return dir + name;
}

// The metrics file's lines as JSON, by step.
inline std::map<long, nlohmann::json> metrics_lines(const std::string& path) {
  std::map<long, nlohmann::json> out;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    auto j = nlohmann::json::parse(line);
    out[j["step"].get<long>()] = j;
  }
  return out;
}

// QTRAIN_TEST_NONFINITE_STEPS for the runs in scope, on every rank.
class NonFiniteSteps {
 public:
  explicit NonFiniteSteps(const std::string& spec) {
    setenv("QTRAIN_TEST_NONFINITE_STEPS", spec.c_str(), 1);
  }
  ~NonFiniteSteps() { unsetenv("QTRAIN_TEST_NONFINITE_STEPS"); }
};

// A run of `ranks` ranks whose gradients are NaN at step 3 (on world rank `poisoned_rank` only,
// or on all with -1) and which checkpoints every step: the state after step 3 is the state after
// step 2, element for element; step 4 changes it again; the metrics mark step 3 alone as skipped
// (its norm null), count it, and the run ends normally. `deck` must checkpoint into `dir`.
inline void expect_skip_changes_nothing(const char* name, int ranks, const std::string& deck,
                                        const std::vector<std::string>& overrides,
                                        const std::string& dir, int poisoned_rank) {
  SCOPED_TRACE(name);
  std::vector<std::string> ov = overrides;
  ov.insert(ov.end(), {"--checkpoint.dir=" + dir, "--checkpoint.every=1", "--checkpoint.keep=10",
                       "--train.steps=5", "--log.every=1"});
  RunResult r;
  {
    NonFiniteSteps poison(poisoned_rank < 0 ? "3" : "3@" + std::to_string(poisoned_rank));
    r = run(ranks, deck, ov, dir + ".jsonl");
  }
  ASSERT_EQ(r.exit_code, 0) << r.error;
  if (world_rank() != 0) return;
  const auto s2 = read_trained_state(step_file(dir, 2));
  const auto s3 = read_trained_state(step_file(dir, 3));
  const auto s4 = read_trained_state(step_file(dir, 4));
  ASSERT_FALSE(s2.empty());
  EXPECT_EQ(differing_elements(s3, s2), 0) << "the skipped step 3 changed the state";
  EXPECT_GT(differing_elements(s4, s3), 0) << "step 4 should update again";
  const auto lines = metrics_lines(dir + ".jsonl");
  ASSERT_EQ(lines.size(), 5u);
  for (const auto& [step, j] : lines) {
    EXPECT_EQ(j["skipped"].get<bool>(), step == 3) << "step " << step;
    EXPECT_EQ(j["skipped_steps"].get<long>(), step >= 3 ? 1 : 0) << "step " << step;
    EXPECT_EQ(j["grad_norm"].is_null(), step == 3) << "step " << step;
    EXPECT_TRUE(j["loss"].is_number()) << "step " << step;  // the loss itself stayed finite
  }
  std::printf("%s: step 3 skipped, its state equal to step 2's; step 4 moved %lld elements\n", name,
              differing_elements(s4, s3));
}

// One mesh of expect_skip_changes_nothing.
struct SkipCase {
  const char* name;
  int ranks;
  std::vector<std::string> overrides;
  int poisoned_rank;  // -1: every rank
};

// expect_skip_changes_nothing for each case, each in its own directory under `tmp`.
inline void expect_skips_change_nothing(const std::vector<SkipCase>& cases, const std::string& deck,
                                        const std::string& tmp) {
  int index = 0;
  for (const SkipCase& c : cases)
    expect_skip_changes_nothing(c.name, c.ranks, deck, c.overrides,
                                tmp + "/case" + std::to_string(index++), c.poisoned_rank);
}

// Gradients NaN at steps 3 and 4 with train.max_consecutive_skips = 2: the run stops at step 4
// with exit code 3; no checkpoint of step 4 is written and the one of step 3 holds step 2's state.
inline void expect_stop_after_consecutive_skips(const char* name, int ranks,
                                                const std::string& deck,
                                                const std::vector<std::string>& overrides,
                                                const std::string& dir) {
  SCOPED_TRACE(name);
  std::vector<std::string> ov = overrides;
  ov.insert(ov.end(), {"--checkpoint.dir=" + dir, "--checkpoint.every=1", "--checkpoint.keep=10",
                       "--train.steps=8", "--log.every=1", "--train.max_consecutive_skips=2"});
  RunResult r;
  {
    NonFiniteSteps poison("3,4");
    r = run(ranks, deck, ov, dir + ".jsonl");
  }
  EXPECT_EQ(r.exit_code, 3);
  if (world_rank() != 0) return;
  const auto lines = metrics_lines(dir + ".jsonl");
  ASSERT_FALSE(lines.empty());
  EXPECT_EQ(lines.rbegin()->first, 4) << "the run should have stopped after step 4";
  EXPECT_EQ(lines.rbegin()->second["skipped_steps"].get<long>(), 2);
  EXPECT_FALSE(std::ifstream(step_file(dir, 4)).good()) << "no checkpoint after the stop";
  EXPECT_EQ(differing_elements(read_trained_state(step_file(dir, 3)),
                               read_trained_state(step_file(dir, 2))),
            0);
}

}  // namespace qt::test
