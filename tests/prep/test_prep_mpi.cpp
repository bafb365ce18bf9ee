// qtrain prep end to end under MPI: fresh random JSONL files of all three forms with malformed,
// blank and too-long lines; the token file written by all ranks equals the one written by rank 0
// alone and the documents a serial RecordEncoder makes of the same lines; bad inputs exit 2.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <mpi.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "data/token_file.h"
#include "prep/prep.h"
#include "prep/records.h"
#include "qtrain/comm.h"
#include "qtrain/data.h"
#include "support/random.h"
#include "tokenizer/qwen3_tokenizer.h"

namespace qt {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

// Every rank calls prep_main on `comm` with these arguments.
int run_prep(std::vector<std::string> args, MpiComm& comm, PrepStats* stats = nullptr) {
  args.insert(args.begin(), "prep");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  return prep_main(static_cast<int>(argv.size()), argv.data(), comm, stats);
}

template <typename T>
std::vector<T> read_column(hid_t file, const char* name, hid_t type) {
  hid_t ds = H5Dopen2(file, name, H5P_DEFAULT);
  EXPECT_GE(ds, 0) << name;
  hid_t space = H5Dget_space(ds);
  const hssize_t n = H5Sget_simple_extent_npoints(space);
  std::vector<T> v(static_cast<std::size_t>(n));
  EXPECT_GE(H5Dread(ds, type, H5S_ALL, H5S_ALL, H5P_DEFAULT, v.data()), 0);
  H5Sclose(space);
  H5Dclose(ds);
  return v;
}

struct TokenFile {
  std::vector<std::int32_t> tokens;
  std::vector<std::int64_t> offsets;
  std::vector<std::uint8_t> mask;
  std::int64_t vocab = 0;
};

TokenFile read_token_file(const std::string& path) {
  TokenFile t;
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  EXPECT_GE(f, 0) << path;
  t.tokens = read_column<std::int32_t>(f, "tokens", H5T_NATIVE_INT32);
  t.offsets = read_column<std::int64_t>(f, "doc_offsets", H5T_NATIVE_INT64);
  t.mask = read_column<std::uint8_t>(f, "loss_mask", H5T_NATIVE_UINT8);
  hid_t a = H5Aopen(f, "vocab_size", H5P_DEFAULT);
  H5Aread(a, H5T_NATIVE_INT64, &t.vocab);
  H5Aclose(a);
  H5Fclose(f);
  return t;
}

// Random records of every form, with problems mixed in; some lines end in CRLF.
std::vector<std::string> random_lines(std::mt19937_64& rng, int n) {
  const std::vector<std::string> words = {"the", "cat",  "sat",    "on",      "mat",
                                          "42",  "über", "日本語", "👍",       "x=1;",
                                          "\t",  "  ",   "\n",     "<think>", "don't"};
  auto text = [&](int max_words) {
    std::string s;
    const int k = 1 + static_cast<int>(rng() % max_words);
    for (int i = 0; i < k; ++i) s += (i ? " " : "") + words[rng() % words.size()];
    return s;
  };
  std::vector<std::string> lines;
  for (int i = 0; i < n; ++i) {
    json j;
    switch (rng() % 9) {
      case 0:
      case 1:
      case 2:
        j = {{"text", text(30)}};
        break;
      case 3:
      case 4:
        j = {{"messages",
              {{{"role", "user"}, {"content", text(8)}},
               {{"role", "assistant"}, {"content", text(8)}}}}};
        break;
      case 5:
        j = {{"instruction", text(5)}, {"input", rng() % 2 ? text(5) : ""}, {"output", text(5)}};
        break;
      case 6:
        lines.push_back(rng() % 2 ? "{\"text\": \"broken" : "");
        continue;
      case 7:
        j = {{"text", text(200)}};
        break;  // often over --max-tokens
      default:
        j = {{"unknown", 1}};
        break;
    }
    lines.push_back(j.dump() + (rng() % 4 == 0 ? "\r" : ""));
  }
  return lines;
}

class PrepMpi : public ::testing::Test {
 protected:
  void SetUp() override {
    world_ = std::make_unique<MpiComm>(MPI_COMM_WORLD, "world", false);
    dir_ = fs::absolute("prep_mpi_work").string();
    if (world_rank() == 0) {
      fs::remove_all(dir_);
      fs::create_directories(dir_);
    }
    world_->barrier();
  }
  void TearDown() override {
    world_->barrier();
    if (world_rank() == 0) fs::remove_all(dir_);
  }
  std::string write(const std::string& name, const std::vector<std::string>& lines,
                    bool final_newline) {
    const std::string path = dir_ + "/" + name;
    if (world_rank() == 0) {
      std::ofstream out(path, std::ios::binary);
      for (std::size_t i = 0; i < lines.size(); ++i)
        out << lines[i] << (i + 1 < lines.size() || final_newline ? "\n" : "");
    }
    return path;
  }
  std::unique_ptr<MpiComm> world_;
  std::string dir_;
  std::vector<std::vector<std::string>> plain_content_;  // PlainText test: lines of each file
  std::vector<std::string> plain_files_;
};

TEST_F(PrepMpi, SameFileOnAnyNumberOfRanks) {
  const std::string tokdir = test::qwen3_tokenizer_dir();
  ASSERT_FALSE(tokdir.empty());
  std::uint64_t seed = test::test_seed();
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);  // the same files on every rank
  std::mt19937_64 rng(seed);
  // A file without a final newline that ends in an empty line ends in "\n": that empty line is no
  // line at all, so the oracle must not see it.
  std::vector<std::vector<std::string>> content = {
      random_lines(rng, 150), {}, random_lines(rng, 70), random_lines(rng, 3)};
  while (!content[2].empty() && content[2].back().empty()) content[2].pop_back();
  std::vector<std::string> files;
  for (std::size_t f = 0; f < content.size(); ++f)
    files.push_back(write("in" + std::to_string(f) + ".jsonl", content[f], f != 2));
  world_->barrier();

  const std::vector<std::string> common = {"--tokenizer", tokdir,       "--max-tokens",
                                           "60",          "--progress", "0"};
  std::vector<std::string> args = common;
  args.insert(args.end(), {"--output", dir_ + "/all.h5"});
  args.insert(args.end(), files.begin(), files.end());
  PrepStats all_stats, one_stats;
  ASSERT_EQ(run_prep(args, *world_, &all_stats), 0);
  if (world_rank() == 0) {
    MpiComm self(MPI_COMM_SELF, "self", false);
    args = common;
    args.insert(args.end(), {"--output", dir_ + "/one.h5"});
    args.insert(args.end(), files.begin(), files.end());
    EXPECT_EQ(run_prep(args, self, &one_stats), 0);

    const TokenFile all = read_token_file(dir_ + "/all.h5"),
                    one = read_token_file(dir_ + "/one.h5");
    EXPECT_EQ(all.tokens, one.tokens);
    EXPECT_EQ(all.offsets, one.offsets);
    EXPECT_EQ(all.mask, one.mask);
    EXPECT_EQ(all.vocab, 151669);
    EXPECT_EQ(one.vocab, 151669);

    // The oracle: the same lines through one RecordEncoder, in order; the first problems with
    // their file:line.
    prep::RecordEncoder enc(test::qwen3_tokenizer(), prep::Format::kAuto, 60, false,
                            "<|endoftext|>");
    TokenFile want;
    want.offsets.push_back(0);
    PrepStats want_stats;
    want_stats.skipped.assign(static_cast<int>(prep::Skip::kCount), 0);
    for (std::size_t f = 0; f < content.size(); ++f) {
      for (std::size_t i = 0; i < content[f].size(); ++i) {
        const prep::RecordResult r = enc.add(content[f][i], want.tokens, want.mask);
        ++want_stats.records;
        if (r.skip == prep::Skip::kNone) {
          want.offsets.push_back(static_cast<std::int64_t>(want.tokens.size()));
          continue;
        }
        ++want_stats.skipped[static_cast<int>(r.skip)];
        if (r.skip != prep::Skip::kEmpty && r.skip != prep::Skip::kTooLong &&
            want_stats.examples.size() < 8)
          want_stats.examples.push_back(files[f] + ":" + std::to_string(i + 1) + ": " +
                                        prep::skip_name(r.skip) + ": " + r.detail);
      }
    }
    EXPECT_GT(want.offsets.size(), 50u);
    EXPECT_EQ(all.tokens, want.tokens);
    EXPECT_EQ(all.offsets, want.offsets);
    EXPECT_EQ(all.mask, want.mask);
    for (const PrepStats* s : {&all_stats, &one_stats}) {
      EXPECT_EQ(s->records, want_stats.records);
      EXPECT_EQ(s->documents, static_cast<std::int64_t>(want.offsets.size()) - 1);
      EXPECT_EQ(s->tokens, static_cast<std::int64_t>(want.tokens.size()));
      EXPECT_EQ(s->skipped, want_stats.skipped);
      EXPECT_EQ(s->examples, want_stats.examples);
    }
    // The engine's reader accepts it.
    EXPECT_NO_THROW(open_token_file(dir_ + "/all.h5", 151936, 16, 1));
  }
}

// Random plain-text lines: words, separator lines ("%", sometimes "%\r"), blank lines, CRLF.
std::vector<std::string> random_plain_lines(std::mt19937_64& rng, int n) {
  const std::vector<std::string> words = {"the", "cat", "über",  "日本語",     "👍",  "%%",
                                          " ",   "\t",  "don't", "<|im_end|>", "--", "Zen"};
  std::vector<std::string> lines;
  for (int i = 0; i < n; ++i) {
    std::string s;
    switch (rng() % 6) {
      case 0:
        s = "%";
        break;
      case 1:
        s = rng() % 2 ? "" : "   ";
        break;
      default:
        for (int k = 0, m = 1 + static_cast<int>(rng() % 12); k < m; ++k)
          s += (k ? " " : "") + words[rng() % words.size()];
    }
    lines.push_back(s + (rng() % 5 == 0 ? "\r" : ""));
  }
  return lines;
}

// The oracle of plain-text prep: each file's lines ('\r' dropped) grouped between separator
// lines; a group of one or more lines is a record, a blank one empty, the others add_text of the
// lines joined by '\n'.
TokenFile plain_oracle(const std::vector<std::vector<std::string>>& content, const std::string& sep,
                       int max_tokens, std::int64_t& records, std::vector<std::int64_t>& skipped) {
  prep::RecordEncoder enc(test::qwen3_tokenizer(), prep::Format::kText, max_tokens, false,
                          "<|endoftext|>");
  TokenFile want;
  want.offsets.push_back(0);
  skipped.assign(static_cast<int>(prep::Skip::kCount), 0);
  records = 0;
  for (const auto& file_lines : content) {
    std::vector<std::string> group;
    auto flush = [&]() {
      if (group.empty()) return;
      ++records;
      std::string text;
      for (std::size_t i = 0; i < group.size(); ++i) text += (i ? "\n" : "") + group[i];
      group.clear();
      if (text.find_first_not_of(" \t\n\r") == std::string::npos) {
        ++skipped[static_cast<int>(prep::Skip::kEmpty)];
        return;
      }
      const prep::RecordResult r = enc.add_text(text, want.tokens, want.mask);
      if (r.skip == prep::Skip::kNone)
        want.offsets.push_back(static_cast<std::int64_t>(want.tokens.size()));
      else
        ++skipped[static_cast<int>(r.skip)];
    };
    for (std::string line : file_lines) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line == sep)
        flush();
      else
        group.push_back(line);
    }
    flush();
  }
  return want;
}

TEST_F(PrepMpi, PlainTextSameFileOnAnyNumberOfRanks) {
  const std::string tokdir = test::qwen3_tokenizer_dir();
  ASSERT_FALSE(tokdir.empty());
  std::uint64_t seed = test::test_seed();
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  std::mt19937_64 rng(seed + 7);
  // Three sets of files of random sizes (the ranks' byte ranges split them at other places),
  // each with the separator "%" and with the default, an empty line.
  // Paragraphs (empty-line separators) are longer: a larger --max-tokens keeps some of them.
  std::int64_t documents = 0, too_long = 0;
  for (int round = 0; round < 6; ++round) {
    const std::string sep = round % 2 ? "" : "%";
    const int max_tokens = sep.empty() ? 150 : 40;
    SCOPED_TRACE("round " + std::to_string(round) + ", separator '" + sep + "'");
    if (round % 2 == 0) {
      std::vector<std::vector<std::string>> content = {
          random_plain_lines(rng, 100 + static_cast<int>(rng() % 300)),
          {"%", "a"},
          random_plain_lines(rng, 41),
          {}};
      // File 2 has no final newline: an empty last line would leave only the "\n" before it,
      // the file of the lines without it, so the oracle would count a line the file lacks.
      if (content[2].back().empty()) content[2].back() = "Zen";
      plain_content_ = content;
      plain_files_.clear();
      for (std::size_t f = 0; f < content.size(); ++f)
        plain_files_.push_back(write("plain" + std::to_string(f) + ".txt", content[f], f != 2));
    }
    world_->barrier();
    const std::vector<std::string> common = {
        "--tokenizer", tokdir, "--format",     "plain",
        "--separator", sep,    "--max-tokens", std::to_string(max_tokens),
        "--progress",  "0"};
    std::vector<std::string> args = common;
    args.insert(args.end(), {"--output", dir_ + "/all.h5"});
    args.insert(args.end(), plain_files_.begin(), plain_files_.end());
    PrepStats all_stats, one_stats;
    EXPECT_EQ(run_prep(args, *world_, &all_stats), 0);  // the same verdict on every rank
    if (world_rank() == 0) {
      MpiComm self(MPI_COMM_SELF, "self", false);
      args = common;
      args.insert(args.end(), {"--output", dir_ + "/one.h5"});
      args.insert(args.end(), plain_files_.begin(), plain_files_.end());
      EXPECT_EQ(run_prep(args, self, &one_stats), 0);
      const TokenFile all = read_token_file(dir_ + "/all.h5"),
                      one = read_token_file(dir_ + "/one.h5");
      std::int64_t records = 0;
      std::vector<std::int64_t> skipped;
      const TokenFile want = plain_oracle(plain_content_, sep, max_tokens, records, skipped);
      documents += static_cast<std::int64_t>(want.offsets.size()) - 1;
      too_long += skipped[static_cast<int>(prep::Skip::kTooLong)];
      for (const TokenFile* t : {&all, &one}) {
        EXPECT_EQ(t->tokens, want.tokens);
        EXPECT_EQ(t->offsets, want.offsets);
        EXPECT_EQ(t->mask, want.mask);
      }
      for (const PrepStats* st : {&all_stats, &one_stats}) {
        EXPECT_EQ(st->records, records);
        EXPECT_EQ(st->documents, static_cast<std::int64_t>(want.offsets.size()) - 1);
        EXPECT_EQ(st->skipped, skipped);
      }
    }
    world_->barrier();
  }
  if (world_rank() == 0) {  // the files did exercise both outcomes
    EXPECT_GT(documents, 20);
    EXPECT_GT(too_long, 0);
  }
}

TEST_F(PrepMpi, BadInputExitsTwoOnEveryRank) {
  const std::string tokdir = test::qwen3_tokenizer_dir();
  ASSERT_FALSE(tokdir.empty());
  const std::string bad = write("bad.jsonl", {"{oops", "", "[1]", R"({"x": 1})"}, true);
  world_->barrier();
  const std::string out = dir_ + "/out.h5";
  EXPECT_EQ(run_prep({"--tokenizer", tokdir, "--output", out, bad}, *world_), 2);  // nothing usable
  EXPECT_EQ(run_prep({"--tokenizer", tokdir, "--output", out, dir_ + "/missing.jsonl"}, *world_),
            2);
  EXPECT_EQ(run_prep({"--tokenizer", dir_ + "/nothing", "--output", out, bad}, *world_), 2);
  EXPECT_EQ(run_prep({"--tokenizer", tokdir, "--output", out, "--format", "poetry", bad}, *world_),
            2);
  EXPECT_EQ(run_prep({"--tokenizer", tokdir, "--output", out, "--bogus", bad}, *world_), 2);
  EXPECT_EQ(run_prep({"--tokenizer", tokdir, "--output", out, "--separator", "%", bad}, *world_),
            2);  // --separator without --format plain
  EXPECT_EQ(run_prep({"--tokenizer", tokdir, "--output", dir_ + "/no/dir/out.h5", bad}, *world_),
            2);
  EXPECT_EQ(run_prep({"--help"}, *world_), 0);
  world_->barrier();
  if (world_rank() == 0) EXPECT_FALSE(fs::exists(out));
}

// An --output that would replace an input or a tokenizer file (under any spelling, through a
// symbolic or a hard link, or as its .tmp), that is a directory, or whose directory is missing or
// not writable: exit 2 on every rank before any work (the stats stay untouched), the message
// names the problem, and nothing is written (issue 15, case 4: the input was replaced, and a
// directory cost all the work, then an internal error and a leftover .tmp).
TEST_F(PrepMpi, OutputThatCannotOrMustNotBeWrittenIsRefusedFirst) {
  const std::string tokdir = test::qwen3_tokenizer_dir();
  ASSERT_FALSE(tokdir.empty());
  const std::string in = write("in.jsonl", {R"({"text": "hello"})"}, true);
  const std::string in_tmp = write("x.h5.tmp", {R"({"text": "bye"})"}, true);
  const std::string tok = dir_ + "/tok";  // a copy: the fixture's files must stay intact
  if (world_rank() == 0) {
    fs::create_directories(tok);
    fs::copy_file(tokdir + "/tokenizer.json", tok + "/tokenizer.json");
    fs::create_directories(dir_ + "/sub");
    fs::create_directories(dir_ + "/y.h5.tmp");
    fs::create_symlink(in, dir_ + "/link.jsonl");
    fs::create_hard_link(in, dir_ + "/hard.jsonl");
  }
  world_->barrier();
  const auto tok_size = fs::file_size(tok + "/tokenizer.json");
  struct Case {
    std::string output, expect;
    std::vector<std::string> inputs;
  };
  const std::vector<Case> cases = {
      {in, "output " + in + " is the input file " + in + "; choose another output", {in}},
      {dir_ + "/./in.jsonl", "is the input file " + in, {in}},
      {dir_ + "/sub/../in.jsonl", "is the input file " + in, {in}},
      {dir_ + "/link.jsonl", "is the input file " + in, {in}},
      {dir_ + "/hard.jsonl", "is the input file " + in, {in}},
      {in, "is the input file " + dir_ + "/link.jsonl", {dir_ + "/link.jsonl"}},
      {dir_ + "/x.h5", "output " + dir_ + "/x.h5: " + in_tmp + " (where it is written first) is the input file", {in, in_tmp}},
      {tok + "/tokenizer.json", "is the tokenizer file " + tok + "/tokenizer.json", {in}},
      {dir_ + "/sub", "output " + dir_ + "/sub: is a directory", {in}},
      {dir_ + "/y.h5", "y.h5.tmp (where it is written first) is a directory", {in}},
      {dir_ + "/in.jsonl/out.h5", "in.jsonl is not a directory", {in}},
      {dir_ + "/none/out.h5", "directory " + dir_ + "/none does not exist", {in}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.output);
    std::vector<std::string> args = {"--tokenizer", tok, "--output", c.output, "--progress", "0"};
    args.insert(args.end(), c.inputs.begin(), c.inputs.end());
    PrepStats stats;
    stats.records = -1;
    if (world_rank() == 0) ::testing::internal::CaptureStderr();
    EXPECT_EQ(run_prep(args, *world_, &stats), 2);  // on every rank
    EXPECT_EQ(stats.records, -1) << "the records were read before the output was checked";
    if (world_rank() == 0) {
      const std::string err = ::testing::internal::GetCapturedStderr();
      EXPECT_EQ(err.rfind("qtrain prep: error: output ", 0), 0u) << err;
      EXPECT_NE(err.find(c.expect), std::string::npos) << err;
    }
    world_->barrier();
  }
  if (world_rank() == 0) {  // nothing was written
    std::ifstream f(in);
    std::string line;
    std::getline(f, line);
    EXPECT_EQ(line, R"({"text": "hello"})");
    EXPECT_EQ(fs::file_size(tok + "/tokenizer.json"), tok_size);
    for (const auto& e : fs::directory_iterator(dir_))
      EXPECT_TRUE(e.path().extension() != ".tmp" || e.path() == in_tmp ||
                  e.path().filename() == "y.h5.tmp")
          << "left behind: " << e.path();
    EXPECT_FALSE(fs::exists(dir_ + "/x.h5"));
  }
  // A directory without write permission (root may write anywhere: checked as another user only).
  if (geteuid() != 0) {
    if (world_rank() == 0) fs::permissions(dir_ + "/sub", fs::perms::owner_write, fs::perm_options::remove);
    world_->barrier();
    PrepStats stats;
    stats.records = -1;
    EXPECT_EQ(run_prep({"--tokenizer", tok, "--output", dir_ + "/sub/out.h5", in}, *world_, &stats), 2);
    EXPECT_EQ(stats.records, -1);
    world_->barrier();
    if (world_rank() == 0) fs::permissions(dir_ + "/sub", fs::perms::owner_write, fs::perm_options::add);
  }
}

// An input that only the last rank reads and cannot open: every rank exits 2 (before, that rank
// alone threw while the others waited in the next collective: a hang). Root may read anything:
// run as another user only.
TEST_F(PrepMpi, UnreadableInputOfOneRankStopsEveryRank) {
  if (geteuid() == 0) GTEST_SKIP() << "root reads a file without read permission";
  const std::string tokdir = test::qwen3_tokenizer_dir();
  ASSERT_FALSE(tokdir.empty());
  const std::string big = write("big.jsonl", std::vector<std::string>(200, R"({"text": "x"})"), true);
  const std::string locked = write("locked.jsonl", {R"({"text": "y"})"}, true);
  if (world_rank() == 0) fs::permissions(locked, fs::perms::none);
  world_->barrier();
  if (world_rank() == 0) ::testing::internal::CaptureStderr();
  EXPECT_EQ(run_prep({"--tokenizer", tokdir, "--output", dir_ + "/out.h5", big, locked}, *world_),
            2);
  if (world_rank() == 0) {
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find("input file " + locked + ": cannot open it for reading"), std::string::npos)
        << err;
    fs::permissions(locked, fs::perms::owner_all);
  }
}

}  // namespace
}  // namespace qt
