// Token files: round trip, the window/target/mask mapping, the per-epoch permutation, and one
// UserError naming the file and dataset for every class of bad file. Serial.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "data/token_file.h"
#include "qtrain/data.h"
#include "qtrain/error.h"
#include "support/random.h"

namespace fs = std::filesystem;

namespace qt {
namespace {

class TokenFile : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/qtrain_tokens_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    rng_.seed(test::test_seed());
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string dir_;
  std::mt19937_64 rng_;
};

// Documents of random lengths covering tokens [0, n).
std::vector<std::int64_t> random_offsets(std::int64_t n, std::mt19937_64& rng) {
  std::vector<std::int64_t> off = {0};
  while (off.back() < n) off.push_back(std::min<std::int64_t>(n, off.back() + 1 + rng() % 40));
  return off;
}

TEST_F(TokenFile, SamplesAreShiftedWindowsWithMaskedTargets) {
  const int T = 7, vocab = 5000;
  const std::int64_t N = 1000 + static_cast<std::int64_t>(rng_() % 100);
  std::vector<std::int32_t> tokens(N);
  std::vector<std::uint8_t> mask(N);
  // Token i is i (so a window identifies itself); ~30 % of targets are masked.
  for (std::int64_t i = 0; i < N; ++i) {
    tokens[i] = static_cast<std::int32_t>(i);
    mask[i] = rng_() % 10 < 7 ? 1 : 0;
  }
  const std::string path = dir_ + "/t.h5";
  write_token_file(path, tokens, random_offsets(N, rng_), mask, vocab);
  const std::uint64_t seed = rng_();
  auto src = open_token_file(path, vocab, T, seed);
  auto lazy = open_token_file_limited(path, vocab, T, seed, 0);  // reads window by window
  EXPECT_TRUE(std::isnan(src->loss_floor()));
  EXPECT_NE(src->describe().find(path), std::string::npos);
  EXPECT_NE(lazy->describe().find("on demand"), std::string::npos);

  const std::int64_t W = (N - 1) / T;
  std::vector<std::int32_t> in(T), tg(T), in2(T), tg2(T);
  std::vector<std::int64_t> first_epoch;
  for (std::int64_t epoch = 0; epoch < 3; ++epoch) {
    std::vector<int> seen(W, 0);
    std::vector<std::int64_t> order;
    for (std::int64_t k = 0; k < W; ++k) {
      const std::int64_t g = epoch * W + k;
      src->sample(g, in.data(), tg.data(), nullptr, T);
      lazy->sample(g, in2.data(), tg2.data(), nullptr, T);
      ASSERT_EQ(in, in2);
      ASSERT_EQ(tg, tg2);
      ASSERT_EQ(in[0] % T, 0) << "windows start at multiples of T";
      const std::int64_t w = in[0] / T;
      ASSERT_LT(w, W);
      ++seen[w];
      order.push_back(w);
      for (int t = 0; t < T; ++t) {
        ASSERT_EQ(in[t], w * T + t);
        const std::int64_t target = w * T + t + 1;
        ASSERT_EQ(tg[t], mask[target] ? tokens[target] : -100) << "sample " << g << " t " << t;
      }
    }
    EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }))
        << "epoch " << epoch << " does not visit every window exactly once";
    EXPECT_EQ(order, token_window_order(W, seed, epoch));
    if (epoch == 0)
      first_epoch = order;
    else
      EXPECT_NE(order, first_epoch) << "epochs should be shuffled differently";
  }
  // Random access, any order, gives the same samples.
  const std::int64_t g = 2 * W + 5;
  src->sample(g, in.data(), tg.data(), nullptr, T);
  src->sample(0, in2.data(), tg2.data(), nullptr, T);
  src->sample(g, in2.data(), tg2.data(), nullptr, T);
  EXPECT_EQ(in, in2);
}

TEST_F(TokenFile, OrderIsAPermutationFixedBySeedAndEpoch) {
  for (std::int64_t W : {1, 2, 3, 10, 1000}) {
    const std::uint64_t seed = rng_();
    const auto a = token_window_order(W, seed, 4);
    auto sorted = a;
    std::sort(sorted.begin(), sorted.end());
    std::vector<std::int64_t> iota(W);
    std::iota(iota.begin(), iota.end(), 0);
    EXPECT_EQ(sorted, iota);
    EXPECT_EQ(a, token_window_order(W, seed, 4));
    if (W >= 10) {
      EXPECT_NE(a, token_window_order(W, seed, 5));
      EXPECT_NE(a, token_window_order(W, seed + 1, 4));
    }
  }
  // Fixed by the documented algorithm: a change of the order would change every resumed run.
  const auto b = token_window_order(1000, 1234, 0);
  const auto b2 = token_window_order(1000, 1234, 0);
  EXPECT_EQ(b, b2);
  // Roughly uniform: the first position takes each window of a small order about equally often.
  std::vector<int> count(4, 0);
  for (std::int64_t e = 0; e < 4000; ++e) ++count[token_window_order(4, 99, e)[0]];
  for (int c : count) EXPECT_NEAR(c, 1000, 150);
}

TEST_F(TokenFile, WithoutMaskEveryTargetCounts) {
  const int T = 4, vocab = 50;
  std::vector<std::int32_t> tokens(41);
  for (auto& t : tokens) t = static_cast<std::int32_t>(rng_() % vocab);
  const std::string path = dir_ + "/nomask.h5";
  write_token_file(path, tokens, {0, 20, 41}, {}, vocab);
  auto src = open_token_file(path, vocab, T, 7);
  std::vector<std::int32_t> in(T), tg(T);
  for (std::int64_t g = 0; g < 10; ++g) {
    src->sample(g, in.data(), tg.data(), nullptr, T);
    const std::int64_t w = token_window_order(10, 7, 0)[g];
    for (int t = 0; t < T; ++t) {
      EXPECT_EQ(in[t], tokens[w * T + t]);
      EXPECT_EQ(tg[t], tokens[w * T + t + 1]);
    }
  }
}

TEST_F(TokenFile, ExactlyOneWindowIsEnough) {
  const int T = 8;
  std::vector<std::int32_t> tokens(T + 1, 3);
  const std::string path = dir_ + "/one.h5";
  write_token_file(path, tokens, {0, T + 1}, {}, 4);
  auto src = open_token_file(path, 4, T, 1);
  std::vector<std::int32_t> in(T), tg(T);
  src->sample(5, in.data(), tg.data(), nullptr, T);  // every epoch is the single window
  EXPECT_EQ(in, std::vector<std::int32_t>(T, 3));
}

// Writes a file with hand-made datasets: tokens/doc_offsets/loss_mask and the attribute, each
// customisable, for the bad-file cases. Values are given as int64; a column of an unsigned type
// receives their bit patterns as uint64 (so -1 writes 2^64 - 1 into a uint64 column).
struct RawFile {
  hid_t tokens_type = H5T_STD_I32LE, offsets_type = H5T_STD_I64LE, mask_type = H5T_STD_U8LE;
  std::vector<hsize_t> tokens_dims = {33};
  std::vector<std::int64_t> tokens;  // values (converted to tokens_type)
  bool with_tokens = true, with_offsets = true;
  std::vector<std::int64_t> offsets = {0, 10, 33};
  std::vector<std::int64_t> mask;  // written when non-empty
  std::optional<std::int64_t> vocab_attr;  // written when set
  hid_t vocab_attr_type = H5T_STD_I64LE;

  static hid_t mem_type(hid_t file_type) {
    return H5Tget_sign(file_type) == H5T_SGN_NONE ? H5T_NATIVE_UINT64 : H5T_NATIVE_INT64;
  }
  void write(const std::string& path) const {
    hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT);
    ASSERT_GE(f, 0);
    auto put = [&](const char* name, hid_t type, const std::vector<hsize_t>& dims,
                   std::vector<std::int64_t> values) {
      hsize_t n = 1;
      for (auto d : dims) n *= d;
      values.resize(n, 1);
      hid_t sp = H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr);
      hid_t ds = H5Dcreate2(f, name, type, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
      H5Dwrite(ds, mem_type(type), H5S_ALL, H5S_ALL, H5P_DEFAULT, values.data());
      H5Dclose(ds);
      H5Sclose(sp);
    };
    if (with_tokens) put("tokens", tokens_type, tokens_dims, tokens);
    if (with_offsets) put("doc_offsets", offsets_type, {offsets.size()}, offsets);
    if (!mask.empty()) put("loss_mask", mask_type, {mask.size()}, mask);
    if (vocab_attr) {
      hid_t sp = H5Screate(H5S_SCALAR);
      hid_t a = H5Acreate2(f, "vocab_size", vocab_attr_type, sp, H5P_DEFAULT, H5P_DEFAULT);
      H5Awrite(a, mem_type(vocab_attr_type), &*vocab_attr);
      H5Aclose(a);
      H5Sclose(sp);
    }
    H5Fclose(f);
  }
};

TEST_F(TokenFile, EveryBadFileIsAUserErrorNamingFileAndDataset) {
  const int vocab = 16, T = 8;
  struct Case {
    const char* what;
    std::function<void(RawFile&)> edit;
    std::vector<std::string> expect;  // substrings of the message besides the path
  };
  const std::vector<Case> cases = {
      {"good file (control)", [](RawFile&) {}, {}},
      {"int64 tokens are fine", [](RawFile& r) { r.tokens_type = H5T_STD_I64LE; }, {}},
      {"no tokens", [](RawFile& r) { r.with_tokens = false; }, {"/tokens", "missing"}},
      {"no doc_offsets", [](RawFile& r) { r.with_offsets = false; }, {"/doc_offsets", "missing"}},
      {"float tokens", [](RawFile& r) { r.tokens_type = H5T_IEEE_F32LE; }, {"/tokens", "integers"}},
      {"2-D tokens",
       [](RawFile& r) {
         r.tokens_dims = {3, 11};
       },
       {"/tokens", "1-D"}},
      {"offsets start at 1",
       [](RawFile& r) {
         r.offsets = {1, 10, 33};
       },
       {"/doc_offsets", "from 0"}},
      {"offsets end early",
       [](RawFile& r) {
         r.offsets = {0, 10, 32};
       },
       {"/doc_offsets", "33"}},
      {"offsets decrease",
       [](RawFile& r) {
         r.offsets = {0, 20, 10, 33};
       },
       {"/doc_offsets", "decreases"}},
      {"id too large", [](RawFile& r) { r.tokens[17] = vocab; }, {"/tokens[17]", "16"}},
      {"negative id", [](RawFile& r) { r.tokens[3] = -1; }, {"/tokens[3]", "-1"}},
      {"too few tokens",
       [](RawFile& r) {
         r.tokens_dims = {8};
         r.tokens.resize(8);
         r.offsets = {0, 8};
       },
       {"/tokens", "9"}},
      {"short loss_mask", [](RawFile& r) { r.mask.assign(32, 1); }, {"/loss_mask", "32", "33"}},
      {"vocab_size attribute too large",
       [](RawFile& r) { r.vocab_attr = vocab + 1; },
       {"vocab_size", "17"}},
      // Values that a 32-bit or signed read would clip: the message gives them as written
      // (issue 15, case 12: 3000000000 was reported as 2147483647).
      {"int64 id beyond int32",
       [](RawFile& r) {
         r.tokens_type = H5T_STD_I64LE;
         r.tokens[5] = 3000000000LL;
       },
       {"/tokens[5] = 3000000000 is outside the vocabulary [0, 16)"}},
      {"int64 id below int32",
       [](RawFile& r) {
         r.tokens_type = H5T_STD_I64LE;
         r.tokens[6] = -3000000000LL;
       },
       {"/tokens[6] = -3000000000"}},
      {"uint32 id beyond int32",
       [](RawFile& r) {
         r.tokens_type = H5T_STD_U32LE;
         r.tokens[7] = 4000000000LL;
       },
       {"/tokens[7] = 4000000000"}},
      {"uint64 id 2^64 - 1",
       [](RawFile& r) {
         r.tokens_type = H5T_STD_U64LE;
         r.tokens[8] = -1;
       },
       {"/tokens[8] = 18446744073709551615"}},
      {"uint64 offsets end at 2^64 - 1",
       [](RawFile& r) {
         r.offsets_type = H5T_STD_U64LE;
         r.offsets = {0, 10, -1};
       },
       {"/doc_offsets[2] = 18446744073709551615"}},
      {"wider than 64 bits",
       [](RawFile& r) {
         r.tokens_type = H5Tcopy(H5T_STD_I64LE);
         H5Tset_precision(r.tokens_type, 96);
       },
       {"/tokens", "at most 64 bits"}},
      {"id below the vocab_size attribute only",
       [](RawFile& r) {
         r.vocab_attr = 8;
         for (auto& t : r.tokens) t %= 8;
         r.tokens[9] = 12;
       },
       {"/tokens[9] = 12 is outside the vocabulary [0, 8) of the file's vocab_size attribute"}},
      {"uint64 vocab_size attribute 2^64 - 1",
       [](RawFile& r) {
         r.vocab_attr_type = H5T_STD_U64LE;
         r.vocab_attr = -1;
       },
       {"vocab_size = 18446744073709551615"}},
      {"loss_mask -1",
       [](RawFile& r) {
         r.mask_type = H5T_STD_I8LE;
         r.mask.assign(33, 1);
         r.mask[4] = -1;
       },
       {"/loss_mask[4] = -1 must be 0 or 1"}},
      {"loss_mask 300",
       [](RawFile& r) {
         r.mask_type = H5T_STD_U16LE;
         r.mask.assign(33, 0);
         r.mask[30] = 300;
       },
       {"/loss_mask[30] = 300 must be 0 or 1"}},
      {"int8 loss_mask of 0 and 1 is fine",
       [](RawFile& r) {
         r.mask_type = H5T_STD_I8LE;
         r.mask.assign(33, 1);
         r.mask[3] = 0;
       },
       {}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    RawFile raw;
    raw.tokens.resize(33);
    for (auto& t : raw.tokens) t = static_cast<std::int64_t>(rng_() % vocab);
    raw.mask.clear();
    c.edit(raw);
    const std::string path = dir_ + "/bad.h5";
    raw.write(path);
    for (std::size_t resident : {kTokenFileResidentBytes, std::size_t{0}}) {  // both readers
      if (c.expect.empty()) {
        EXPECT_NO_THROW(open_token_file_limited(path, vocab, T, 1, resident));
        continue;
      }
      try {
        open_token_file_limited(path, vocab, T, 1, resident);
        ADD_FAILURE() << "no UserError";
      } catch (const UserError& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find(path), std::string::npos) << msg;
        for (const auto& s : c.expect)
          EXPECT_NE(msg.find(s), std::string::npos) << "'" << s << "' not in: " << msg;
      }
    }
  }
}

TEST_F(TokenFile, MissingOrNonHdf5FileIsAUserError) {
  const std::string missing = dir_ + "/none.h5";
  try {
    open_token_file(missing, 10, 4, 1);
    ADD_FAILURE() << "no UserError";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos);
  }
  const std::string junk = dir_ + "/junk.h5";
  std::ofstream(junk) << "not hdf5";
  try {
    open_token_file(junk, 10, 4, 1);
    ADD_FAILURE() << "no UserError";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find(junk), std::string::npos) << e.what();
  }
}

TEST_F(TokenFile, WriterRejectsInconsistentInput) {
  const std::string path = dir_ + "/w.h5";
  EXPECT_THROW(write_token_file(path, {1, 2, 3}, {0, 2}, {}, 10), UserError);
  EXPECT_THROW(write_token_file(path, {1, 2, 3}, {0, 2, 1, 3}, {}, 10), UserError);
  EXPECT_THROW(write_token_file(path, {1, 2, 3}, {0, 3}, {1, 1}, 10), UserError);
  EXPECT_THROW(write_token_file(path, {1, 2, 30}, {0, 3}, {}, 10), UserError);
  EXPECT_THROW(write_token_file(dir_ + "/no/such/dir/w.h5", {1}, {0, 1}, {}, 10), UserError);
}

}  // namespace
}  // namespace qt
