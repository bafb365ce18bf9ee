// log.tensorboard end to end: the tiny deck on the world's ranks, stopped and resumed, writes
// two event files in one directory whose train/loss points are the JSON lines' steps and losses,
// with the resolved deck as text at each run's first step (tests/support/event_file_reader.h
// reads them; tests/reference/tensorboard_check.py does the same with TensorBoard's own reader).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "support/event_file_reader.h"
#include "training_harness.h"

namespace qt {
namespace {

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Rank 0's checks of the two runs' event files (in a function of its own: a failed ASSERT leaves
// it, not the test, so the barrier after it still runs and no rank is left waiting).
void check_event_files(const std::string& tb, const test::RunResult& b, int ranks) {
  const std::vector<std::string> files = test::event_files(tb);
  ASSERT_EQ(files.size(), 2u) << "one event file a run";
  std::vector<tensorboard::Event> events;
  std::vector<std::int64_t> deck_steps;
  for (const std::string& f : files) {
    const std::vector<tensorboard::Event> e = test::parse_events(test::read_records(f));
    ASSERT_FALSE(e.empty());
    EXPECT_EQ(e[0].file_version(), "brain.Event:2");
    for (const tensorboard::Event& x : e) {
      for (const auto& v : x.summary().value()) {
        if (v.tag() != "config/deck") continue;
        deck_steps.push_back(x.step());
        EXPECT_EQ(v.metadata().plugin_data().plugin_name(), "text");
        ASSERT_EQ(v.tensor().string_val_size(), 1);
        EXPECT_NE(v.tensor().string_val(0).find("tensorboard = " + tb + "\n"), std::string::npos);
        EXPECT_NE(v.tensor().string_val(0).find("[model]\npreset = tiny\n"), std::string::npos);
      }
    }
    events.insert(events.end(), e.begin(), e.end());
  }
  EXPECT_EQ(deck_steps, (std::vector<std::int64_t>{0, 3}));
  const test::ScalarSeries s = test::scalar_series(events);
  const auto& loss = s.at("train/loss");
  ASSERT_EQ(loss.size(), b.steps.size());
  for (std::size_t i = 0; i < loss.size(); ++i) {
    EXPECT_EQ(loss[i].first, b.steps[i].step);
    EXPECT_EQ(loss[i].second, static_cast<float>(b.steps[i].loss)) << "step " << loss[i].first;
  }
  for (const char* tag : {"train/lr", "train/grad_norm", "perf/tokens_per_s", "time/compute_s",
                          "memory/params_gib", "memory/total_gib"})
    EXPECT_EQ(s.count(tag) ? s.at(tag).size() : 0u, loss.size()) << tag;
  EXPECT_GT(s.at("memory/params_gib")[0].second, 0.0f);
  EXPECT_EQ(s.count("moe/aux_loss"), 0u);  // a dense model
  if (ranks > 1) {  // the dp reductions
    bool comm = false;
    for (const auto& [tag, points] : s) comm |= tag.rfind("comm/", 0) == 0 && tag.ends_with("_ms");
    EXPECT_TRUE(comm) << "no comm/<name>_ms tag at dp " << ranks;
  }
}

TEST(TensorBoardRun, StoppedAndResumedRunsWriteEveryLoggedStep) {
  const std::string dir = test::shared_temp_dir("tensorboard");
  const std::string deck = read_text(QT_INPUTS_DIR "/tiny.ini");
  const std::string tb = dir + "/tb/run";  // created, with its parent
  const std::vector<std::string> common = {
      "--train.steps=6", "--log.every=2", "--checkpoint.every=0", "--checkpoint.dir=" + dir + "/ckpt",
      "--checkpoint.resume=auto", "--log.tensorboard=" + tb};
  std::vector<std::string> first = common;
  first.push_back("--train.stop_at=3");  // logs 1 (the first step), 2, 3 (the last)
  const int ranks = std::min(2, test::world_size());
  const test::RunResult a = test::run(ranks, deck, first, dir + "/metrics.jsonl");
  ASSERT_EQ(a.exit_code, 0) << a.error;
  const test::RunResult b = test::run(ranks, deck, common, dir + "/metrics.jsonl");  // 4, 6
  ASSERT_EQ(b.exit_code, 0) << b.error;
  ASSERT_EQ(b.steps.size(), 5u);  // the metrics file is appended to: both runs' lines

  if (test::world_rank() == 0) check_event_files(tb, b, ranks);
  MPI_Barrier(MPI_COMM_WORLD);
  if (test::world_rank() == 0) std::filesystem::remove_all(dir);
}

TEST(TensorBoardRun, AFileInThePlaceOfTheDirectoryStopsEveryRank) {
  const std::string dir = test::shared_temp_dir("tensorboard-bad");
  if (test::world_rank() == 0) std::ofstream(dir + "/taken") << "x";
  MPI_Barrier(MPI_COMM_WORLD);
  const test::RunResult r =
      test::run(test::world_size(), read_text(QT_INPUTS_DIR "/tiny.ini"),
                {"--train.steps=2", "--checkpoint.every=-1", "--checkpoint.resume=none",
                 "--checkpoint.dir=" + dir + "/ckpt", "--log.tensorboard=" + dir + "/taken"},
                dir + "/metrics.jsonl");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.error.find("log.tensorboard = " + dir + "/taken: it is not a directory"),
            std::string::npos)
      << r.error;
  MPI_Barrier(MPI_COMM_WORLD);
  if (test::world_rank() == 0) std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace qt
