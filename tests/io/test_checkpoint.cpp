// Parallel-HDF5 checkpoints: bit-exact round trips at this world size and across world sizes
// (written by a sub-communicator, read by the world and back), every class of bad file becoming
// the same UserError on every rank, listing and pruning. Run under mpiexec with 1, 2 and 4 ranks.
#include <gtest/gtest.h>
#include <hdf5.h>
#include <mpi.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "io/hdf5_util.h"
#include "io/redistribute.h"
#include "qtrain/checkpoint.h"
#include "qtrain/error.h"
#include "io/checkpoint_cases.h"
#include "support/mpi_world.h"
#include "support/random.h"

namespace fs = std::filesystem;

namespace qt {
namespace {

using test::barrier;
using test::bcast_string;
using test::make_mesh;
using test::same_bits;
using test::world_rank;
using test::world_size;
using test::odd_model;
using test::some_state;
using Tensors = test::StateTensors;

// Random params and moments identical on every rank (rank 0's seed).
Tensors random_state_shared(std::size_t n) { return test::random_state(n, test::shared_seed()); }

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

const char* kDeck = "[model]\npreset = custom\n[train]\nseq_len = 8   # with a comment\n";

// A world-sized mesh, or one over the first k ranks of the world (nullptr on the others).
// Writes `t` with moments held as `shard` (a range of rank r of `mesh`): each rank passes the
// moments of its own shard only.
void write(const std::string& path, Mesh& mesh, const ModelConfig& m, const Tensors& t,
           Range shard) {
  ParamLayout layout(m);
  MomentShard ms{shard, const_cast<float*>(t.exp_avg.data()) + shard.begin,
                 const_cast<float*>(t.exp_avg_sq.data()) + shard.begin};
  checkpoint_write(path, mesh, layout, t.params.data(), ms, some_state(), m, kDeck);
}

// Bit-for-bit equality of two float arrays (NaN payloads and -0 included).
// Reads into fresh buffers with moments for `range`; checks everything bit for bit against `t`.
void read_and_compare(const std::string& path, Mesh& mesh, const ModelConfig& m, const Tensors& t,
                      Range range) {
  ParamLayout layout(m);
  std::vector<float> params(layout.numel(), -1.0f), ea(range.size(), -1.0f),
      eas(range.size(), -1.0f);
  MomentShard ms{range, ea.data(), eas.data()};
  const TrainState s = checkpoint_read(path, mesh, layout, params.data(), ms, m);
  const TrainState want = some_state();
  EXPECT_EQ(s.step, want.step);
  EXPECT_EQ(s.samples_consumed, want.samples_consumed);
  EXPECT_EQ(s.tokens_consumed, want.tokens_consumed);
  EXPECT_EQ(s.seed, want.seed);
  EXPECT_EQ(s.rng_counter, want.rng_counter);
  EXPECT_TRUE(same_bits(params.data(), t.params.data(), params.size()))
      << "params differ on rank " << world_rank();
  EXPECT_TRUE(same_bits(ea.data(), t.exp_avg.data() + range.begin, ea.size()))
      << "exp_avg [" << range.begin << ", " << range.end << ") differs on rank " << world_rank();
  EXPECT_TRUE(same_bits(eas.data(), t.exp_avg_sq.data() + range.begin, eas.size()))
      << "exp_avg_sq differs on rank " << world_rank();
}

// Expects `f` to throw UserError on every rank with the same message containing every `parts`.
void expect_user_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  std::string msg;
  bool thrown = false;
  try {
    f();
  } catch (const UserError& e) {
    thrown = true;
    msg = e.what();
  }
  ASSERT_TRUE(thrown) << "no UserError on rank " << world_rank();
  for (const auto& p : parts)
    EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  EXPECT_EQ(bcast_string(msg), msg) << "ranks disagree on the message";
}

class Checkpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string d;
    if (world_rank() == 0) {
      char tmpl[] = "ckpt_test_XXXXXX";
      ASSERT_NE(mkdtemp(tmpl), nullptr);
      d = fs::absolute(tmpl).string();
    }
    dir_ = bcast_string(d);
    world_ = std::make_shared<MpiComm>(MPI_COMM_WORLD, "world", false);
    MeshShape shape;
    shape.dp = world_size();
    mesh_ = std::make_unique<Mesh>(shape, world_);
  }
  void TearDown() override {
    barrier();
    if (world_rank() == 0) fs::remove_all(dir_);
  }

  // Reads `path` with the model and layout of `m` into scratch buffers.
  void read_scratch(const std::string& path, const ModelConfig& m) {
    ParamLayout layout(m);
    std::vector<float> p(layout.numel()), ea(layout.numel()), eas(layout.numel());
    checkpoint_read(path, *mesh_, layout, p.data(),
                    MomentShard{Range{0, layout.numel()}, ea.data(), eas.data()}, m);
  }

  // A checkpoint of odd_model() written by the whole world, copied to `copy` by rank 0 (which
  // then applies `damage` to the copy).
  void make_damaged_copy(const std::string& copy,
                         const std::function<void(const std::string&)>& damage) {
    const ModelConfig m = odd_model();
    const Tensors t = random_state_shared(ParamLayout(m).numel());
    const std::string path = checkpoint_path(dir_, 1);
    if (!fs::exists(path)) write(path, *mesh_, m, t, Range{0, t.params.size()});
    barrier();
    if (world_rank() == 0) {
      fs::copy_file(path, copy, fs::copy_options::overwrite_existing);
      damage(copy);
    }
    barrier();
  }

  std::string dir_;
  std::shared_ptr<MpiComm> world_;
  std::unique_ptr<Mesh> mesh_;
};

TEST_F(Checkpoint, RoundTripIsBitExactForEveryMomentRange) {
  const ModelConfig m = odd_model();
  const std::size_t n = ParamLayout(m).numel();
  const Tensors t = random_state_shared(n);
  const int P = world_size(), r = world_rank();
  const std::string path = checkpoint_path(dir_, 17);
  EXPECT_EQ(path, dir_ + "/step_00000017.h5");

  // ZeRO-0 style: every rank holds all moments.
  write(path, *mesh_, m, t, Range{0, n});
  EXPECT_TRUE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  const std::string bytes = world_rank() == 0 ? read_bytes(path) : "";
  read_and_compare(path, *mesh_, m, t, Range{0, n});
  read_and_compare(path, *mesh_, m, t, split_range(n, P, r));         // ZeRO-1 shard
  read_and_compare(path, *mesh_, m, t, split_range(n, 3, r % 3));     // a shard of another dp size
  read_and_compare(path, *mesh_, m, t, Range{n / 3 + r, n / 3 + r});  // empty
  read_and_compare(path, *mesh_, m, t, Range{n - 1 - r, n});          // overlapping tails
  if (world_rank() == 0) EXPECT_EQ(read_bytes(path), bytes) << "reading modified the file";

  // ZeRO-1 style writer: each rank passes only its shard.
  const std::string path2 = checkpoint_path(dir_, 18);
  write(path2, *mesh_, m, t, split_range(n, P, r));
  read_and_compare(path2, *mesh_, m, t, Range{0, n});
}

// The checksum as docs/checkpoints.md defines it, written out independently of the engine.
std::uint64_t documented_checksum(const std::vector<float>& x) {
  const std::uint64_t G = 0x9E3779B97F4A7C15ull;
  std::uint64_t sum = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    std::uint32_t bits;
    std::memcpy(&bits, &x[i], 4);
    std::uint64_t z = ((i * G) ^ bits) + G;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    sum += z ^ (z >> 31);
  }
  return sum;
}

TEST_F(Checkpoint, FileHasTheDocumentedLayout) {
  const ModelConfig m = odd_model();
  const ParamLayout layout(m);
  const Tensors t = random_state_shared(layout.numel());
  const std::string path = checkpoint_path(dir_, 5);
  write(path, *mesh_, m, t, Range{0, layout.numel()});
  if (world_rank() != 0) return;
  hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  const ParamInfo& p = layout.find("model.layers.1.mlp.down_proj.weight");
  for (const char* g : {"/params/", "/optim/exp_avg/", "/optim/exp_avg_sq/"}) {
    const std::string name = g + p.name;
    hid_t ds = H5Dopen2(f, name.c_str(), H5P_DEFAULT);
    ASSERT_GE(ds, 0) << name;
    hid_t sp = H5Dget_space(ds);
    hsize_t dims[2] = {0, 0};
    EXPECT_EQ(H5Sget_simple_extent_ndims(sp), 2);
    H5Sget_simple_extent_dims(sp, dims, nullptr);
    EXPECT_EQ(dims[0], 12u);
    EXPECT_EQ(dims[1], 20u);
    std::vector<float> data(p.numel);
    H5Dread(ds, H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, data.data());
    const auto& src = std::string(g) == "/params/"          ? t.params
                      : std::string(g) == "/optim/exp_avg/" ? t.exp_avg
                                                            : t.exp_avg_sq;
    EXPECT_EQ(0, std::memcmp(data.data(), src.data() + p.offset, p.numel * sizeof(float))) << name;
    std::uint64_t stored = 0;
    hid_t attr = H5Aopen(ds, "checksum", H5P_DEFAULT);
    ASSERT_GE(attr, 0);
    H5Aread(attr, H5T_NATIVE_UINT64, &stored);
    H5Aclose(attr);
    EXPECT_EQ(stored, documented_checksum(data)) << name;
    H5Sclose(sp);
    H5Dclose(ds);
  }
  for (const char* a : {"format", "format_version", "step", "samples_consumed", "tokens_consumed",
                        "seed", "rng_counter", "deck", "vocab_size", "hidden_size",
                        "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                        "rope_theta", "rms_norm_eps", "tie_word_embeddings"})
    EXPECT_GT(H5Aexists(f, a), 0) << a;
  H5Fclose(f);
}

TEST_F(Checkpoint, LoadsAcrossWorldSizes) {
  const ModelConfig m = odd_model();
  const std::size_t n = ParamLayout(m).numel();
  const Tensors t = random_state_shared(n);
  const int P = world_size(), r = world_rank();
  for (int k : {1, 2, 3}) {
    if (k > P || (k == P && P > 1)) continue;  // k == P is the plain round trip
    // Written by the first k ranks (ZeRO-1 shards of size k), read by the whole world.
    const std::string path = checkpoint_path(dir_, 100 + k);
    if (auto sub = make_mesh(k)) write(path, *sub, m, t, split_range(n, k, sub->world_rank()));
    barrier();
    read_and_compare(path, *mesh_, m, t, split_range(n, P, r));
    read_and_compare(path, *mesh_, m, t, Range{0, n});
  }
  // Written by the world, read by the first k ranks.
  const std::string path = checkpoint_path(dir_, 200);
  write(path, *mesh_, m, t, split_range(n, P, r));
  for (int k : {1, 2}) {
    if (k > P) continue;
    if (auto sub = make_mesh(k)) {
      read_and_compare(path, *sub, m, t, split_range(n, k, sub->world_rank()));
      read_and_compare(path, *sub, m, t, Range{0, n});
    }
    barrier();
  }
}

TEST_F(Checkpoint, NewCheckpointLeavesOldOnesUntouched) {
  const ModelConfig m = odd_model();
  const std::size_t n = ParamLayout(m).numel();
  const Tensors t = random_state_shared(n);
  write(checkpoint_path(dir_, 1), *mesh_, m, t, Range{0, n});
  const std::string before = world_rank() == 0 ? read_bytes(checkpoint_path(dir_, 1)) : "";
  Tensors t2 = t;
  for (auto& x : t2.params) x += 1.0f;
  write(checkpoint_path(dir_, 2), *mesh_, m, t2, Range{0, n});
  if (world_rank() == 0) EXPECT_EQ(read_bytes(checkpoint_path(dir_, 1)), before);
  read_and_compare(checkpoint_path(dir_, 1), *mesh_, m, t, Range{0, n});
  read_and_compare(checkpoint_path(dir_, 2), *mesh_, m, t2, Range{0, n});
  // Rewriting the same step replaces the file only when the new one is complete.
  write(checkpoint_path(dir_, 2), *mesh_, m, t, Range{0, n});
  read_and_compare(checkpoint_path(dir_, 2), *mesh_, m, t, Range{0, n});
}

TEST_F(Checkpoint, CreatesMissingDirectories) {
  const ModelConfig m = odd_model();
  const std::size_t n = ParamLayout(m).numel();
  const Tensors t = random_state_shared(n);
  const std::string path = checkpoint_path(dir_ + "/a/b", 3);
  write(path, *mesh_, m, t, Range{0, n});
  read_and_compare(path, *mesh_, m, t, Range{0, n});
}

TEST_F(Checkpoint, MissingFileIsAUserError) {
  const std::string path = dir_ + "/step_00000099.h5";
  expect_user_error([&] { read_scratch(path, odd_model()); }, {path, "no such file"});
}

TEST_F(Checkpoint, NotHdf5IsAUserError) {
  const std::string path = dir_ + "/junk.h5";
  if (world_rank() == 0) std::ofstream(path) << "this is not an HDF5 file\n";
  barrier();
  expect_user_error([&] { read_scratch(path, odd_model()); }, {path});
}

TEST_F(Checkpoint, TruncatedFileIsAUserError) {
  const std::string copy = dir_ + "/truncated.h5";
  make_damaged_copy(copy, [](const std::string& p) { fs::resize_file(p, fs::file_size(p) / 2); });
  expect_user_error([&] { read_scratch(copy, odd_model()); }, {copy});
  make_damaged_copy(copy, [](const std::string& p) { fs::resize_file(p, fs::file_size(p) - 1); });
  expect_user_error([&] { read_scratch(copy, odd_model()); }, {copy});
}

// Flips one byte inside the data of dataset `name` (contiguous, so H5Dget_offset is its start).
void flip_byte(const std::string& file, const std::string& name, std::size_t element) {
  hid_t f = H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  ASSERT_GE(f, 0);
  hid_t ds = H5Dopen2(f, name.c_str(), H5P_DEFAULT);
  ASSERT_GE(ds, 0);
  const haddr_t off = H5Dget_offset(ds);
  ASSERT_NE(off, HADDR_UNDEF);
  H5Dclose(ds);
  H5Fclose(f);
  std::fstream io(file, std::ios::in | std::ios::out | std::ios::binary);
  io.seekg(static_cast<std::streamoff>(off + 4 * element + 2));
  char c = 0;
  io.get(c);
  io.seekp(static_cast<std::streamoff>(off + 4 * element + 2));
  io.put(static_cast<char>(c ^ 0x10));
}

TEST_F(Checkpoint, CorruptDataIsAUserErrorNamingTheTensor) {
  const std::string copy = dir_ + "/corrupt.h5";
  const char* cases[][2] = {{"/params/", "model.layers.1.mlp.down_proj.weight"},
                            {"/optim/exp_avg/", "model.embed_tokens.weight"},
                            {"/optim/exp_avg_sq/", "lm_head.weight"},
                            {"/params/", "model.norm.weight"}};
  for (const auto& c : cases) {
    const std::string name = std::string(c[0]) + c[1];
    make_damaged_copy(copy, [&](const std::string& p) { flip_byte(p, name, 7); });
    expect_user_error([&] { read_scratch(copy, odd_model()); }, {copy, name, "checksum"});
  }
}

TEST_F(Checkpoint, ModelMismatchIsAUserErrorNamingTheField) {
  const std::string path = checkpoint_path(dir_, 1);
  make_damaged_copy(dir_ + "/unused.h5", [](const std::string&) {});
  struct Case {
    const char* field;
    std::function<void(ModelConfig&)> change;
    const char* have;
    const char* want;
  };
  const Case cases[] = {
      {"hidden_size", [](ModelConfig& m) { m.hidden_size = 16; }, "12", "16"},
      {"num_kv_heads", [](ModelConfig& m) { m.num_kv_heads = 2; }, "1", "2"},
      {"rope_theta", [](ModelConfig& m) { m.rope_theta = 1e6; }, "12345.5", "1000000"},
      {"tie_word_embeddings", [](ModelConfig& m) { m.tie_word_embeddings = true; }, "false",
       "true"}};
  for (const auto& c : cases) {
    ModelConfig m = odd_model();
    c.change(m);
    expect_user_error([&] { read_scratch(path, m); },
                      {path, std::string("model.") + c.field, c.have, c.want});
  }
}

TEST_F(Checkpoint, MissingOrMisshapenTensorIsAUserError) {
  const std::string copy = dir_ + "/edited.h5";
  const std::string name = "/optim/exp_avg/model.layers.0.self_attn.k_proj.weight";
  auto edit = [&](bool recreate) {
    return [&, recreate](const std::string& p) {
      hid_t f = H5Fopen(p.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
      ASSERT_GE(f, 0);
      ASSERT_GE(H5Ldelete(f, name.c_str(), H5P_DEFAULT), 0);
      if (recreate) {
        hsize_t dims[2] = {6, 13};
        hid_t sp = H5Screate_simple(2, dims, nullptr);
        hid_t ds =
            H5Dcreate2(f, name.c_str(), H5T_IEEE_F32LE, sp, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT);
        H5Dclose(ds);
        H5Sclose(sp);
      }
      H5Fclose(f);
    };
  };
  make_damaged_copy(copy, edit(false));
  expect_user_error([&] { read_scratch(copy, odd_model()); }, {copy, name, "missing"});
  make_damaged_copy(copy, edit(true));
  expect_user_error([&] { read_scratch(copy, odd_model()); }, {copy, name, "[6, 13]", "[6, 12]"});
  make_damaged_copy(copy, [](const std::string& p) {
    hid_t f = H5Fopen(p.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(H5Ldelete(f, "/optim", H5P_DEFAULT), 0);
    H5Fclose(f);
  });
  expect_user_error([&] { read_scratch(copy, odd_model()); }, {copy, "/optim/exp_avg/", "missing"});
}

TEST_F(Checkpoint, WrongFormatAttributeIsAUserError) {
  const std::string copy = dir_ + "/format.h5";
  make_damaged_copy(copy, [](const std::string& p) {
    hid_t f = H5Fopen(p.c_str(), H5F_ACC_RDWR, H5P_DEFAULT);
    ASSERT_GE(H5Adelete(f, "format"), 0);
    H5Fclose(f);
  });
  expect_user_error([&] { read_scratch(copy, odd_model()); }, {copy, "format"});
}

TEST_F(Checkpoint, ListIsNewestFirstAndIgnoresOtherFiles) {
  Comm& world = *world_;
  EXPECT_TRUE(checkpoint_list(dir_ + "/nonexistent", world).empty());
  if (world_rank() == 0) {
    for (const char* f : {"step_00000003.h5", "step_00000010.h5", "step_00000002.h5",
                          "step_00000011.h5.tmp", "step_00000001.h5.tmp", "other.h5", "step_4.h5",
                          "step_00000012.h5.bak", "step_000000aa.h5"})
      std::ofstream(dir_ + "/" + f) << "x";
    fs::create_directory(dir_ + "/step_00000099.h5");  // a directory, not a checkpoint
  }
  barrier();
  const std::vector<std::string> want = {checkpoint_path(dir_, 10), checkpoint_path(dir_, 3),
                                         checkpoint_path(dir_, 2)};
  EXPECT_EQ(checkpoint_list(dir_, world), want);

  // Names too long for a 64-bit step are not checkpoints (they threw std::out_of_range).
  if (world_rank() == 0) std::ofstream(dir_ + "/step_99999999999999999999999.h5") << "x";
  barrier();
  EXPECT_EQ(checkpoint_list(dir_, world), want);
}

TEST(CheckpointStep, OfNamesAndPaths) {
  EXPECT_EQ(checkpoint_step("step_00000010.h5"), 10);
  EXPECT_EQ(checkpoint_step("/a/b/step_123456789012.h5"), 123456789012);
  EXPECT_EQ(checkpoint_step("step_00000010.h5.tmp"), -1);
  EXPECT_EQ(checkpoint_step("step_10.h5"), -1);
  EXPECT_EQ(checkpoint_step("step_0000001x.h5"), -1);
  EXPECT_EQ(checkpoint_step("step_9999999999999999999.h5"), -1);  // 19 digits: beyond int64
  EXPECT_EQ(checkpoint_step("other.h5"), -1);
}

TEST(Redistribute, AnyRangesInManySmallRounds) {
  MpiComm world(MPI_COMM_WORLD, "world", false);
  const int P = world.size(), r = world.rank();
  std::uint64_t seed = r == 0 ? test::test_seed() : 0;
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  std::mt19937_64 rng(seed);
  for (int trial = 0; trial < 20; ++trial) {
    const std::size_t n = rng() % 200;  // 0 included
    std::vector<float> all(n);
    for (std::size_t i = 0; i < n; ++i) all[i] = static_cast<float>(i) + 0.25f;
    // Random ranges, different on every rank (same generator, drawn in rank order).
    Range want;
    for (int s = 0; s < P; ++s) {
      std::size_t a = n ? rng() % (n + 1) : 0, b = n ? rng() % (n + 1) : 0;
      if (s == r) want = Range{std::min(a, b), std::max(a, b)};
    }
    const Range part = split_range(n, P, r);
    std::vector<float> out(want.size(), -1.0f);
    const std::size_t stage = 1 + rng() % 9;  // tiny: many rounds
    redistribute_flat(world, n, all.data() + part.begin, want, out.data(), stage);
    EXPECT_TRUE(std::equal(out.begin(), out.end(), all.begin() + want.begin))
        << "trial " << trial << " range [" << want.begin << ", " << want.end << ") stage " << stage;
  }
}

TEST(FlatRangeBlocks, CoverExactlyTheRangeInRowMajorOrder) {
  std::mt19937_64 rng(test::test_seed());
  for (int trial = 0; trial < 300; ++trial) {
    const int rank = 1 + static_cast<int>(rng() % 3);
    std::vector<hsize_t> dims(rank);
    hsize_t n = 1;
    for (auto& d : dims) n *= (d = 1 + rng() % 5);
    hsize_t lo = rng() % (n + 1), hi = rng() % (n + 1);
    if (lo > hi) std::swap(lo, hi);
    const auto blocks = h5::flat_range_blocks(dims, lo, hi);
    EXPECT_LE(blocks.size(), static_cast<std::size_t>(2 * rank - 1));
    // Flat indices covered by the blocks, in block order then row-major within a block.
    std::vector<hsize_t> covered;
    for (const auto& b : blocks) {
      std::vector<hsize_t> idx(b.start);
      hsize_t count = 1;
      for (auto c : b.count) count *= c;
      for (hsize_t k = 0; k < count; ++k) {
        hsize_t rem = k, flat = 0;
        for (int a = rank - 1; a >= 0; --a) {
          idx[a] = b.start[a] + rem % b.count[a];
          rem /= b.count[a];
        }
        for (int a = 0; a < rank; ++a) flat = flat * dims[a] + idx[a];
        covered.push_back(flat);
      }
    }
    std::vector<hsize_t> want(hi - lo);
    std::iota(want.begin(), want.end(), lo);
    EXPECT_EQ(covered, want) << "rank " << rank << " [" << lo << ", " << hi << ")";
  }
}

}  // namespace
}  // namespace qt
