// The sharded state's I/O: redistribute_pieces between random piece layouts in many small rounds,
// checkpoints written from the pieces of a ZeRO-style partition and read bit for bit into other
// targets (full buffers, another partition, overlapping ranges, another world size), and files of
// the flat-buffer API and of pieces read by each other. Run under mpiexec with 1 to 4 ranks.
// (Pieces that overlap or leave a gap: bad_pieces.cpp and expect_abort.sh.)
#include <gtest/gtest.h>
#include <mpi.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

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
using test::random_state;
using test::shared_seed;
using test::some_state;
using State = test::StateTensors;

// A buffer of n floats between guard floats, to catch writes outside a piece.
constexpr std::size_t kGuard = 4;
constexpr float kGuardValue = -12345.0f;
struct Guarded {
  std::vector<float> buf;
  explicit Guarded(std::size_t n) : buf(n + 2 * kGuard, kGuardValue) {}
  float* data() { return buf.data() + kGuard; }
  bool guards_intact() const {
    for (std::size_t i = 0; i < kGuard; ++i)
      if (buf[i] != kGuardValue || buf[buf.size() - 1 - i] != kGuardValue) return false;
    return true;
  }
};

// Random flat ranges of [0, n), drawn alike on every rank: `cuts` cut points give cuts + 1
// pieces of a partition (some empty), in random order.
std::vector<Range> random_partition(std::size_t n, std::size_t cuts, std::mt19937_64& rng) {
  std::vector<std::size_t> at{0, n};
  for (std::size_t i = 0; i < cuts; ++i) at.push_back(n ? rng() % (n + 1) : 0);
  std::sort(at.begin(), at.end());
  std::vector<Range> out;
  for (std::size_t i = 0; i + 1 < at.size(); ++i) out.push_back(Range{at[i], at[i + 1]});
  std::shuffle(out.begin(), out.end(), rng);
  return out;
}

// n integer-valued floats in [-1e6, 1e6] (exact in fp32: compared bit for bit).
std::vector<float> random_values(std::size_t n, std::mt19937_64& rng) {
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(static_cast<std::int64_t>(rng() % 2000001) - 1000000);
  return v;
}

Range random_range(std::size_t n, std::mt19937_64& rng) {
  std::size_t a = rng() % (n + 1), b = rng() % (n + 1);
  return Range{std::min(a, b), std::max(a, b)};
}

TEST(RedistributePieces, RandomLayoutsInManySmallRounds) {
  MpiComm world(MPI_COMM_WORLD, "world", false);
  const int P = world.size(), me = world.rank();
  const std::uint64_t base = shared_seed();
  for (std::uint64_t trial = 0; trial < 24; ++trial) {
    const std::uint64_t seed = base + trial;
    SCOPED_TRACE(testing::Message() << "trial seed " << seed << " (QT_TEST_SEED=" << base << ")");
    std::mt19937_64 rng(seed);  // every rank draws every rank's pieces alike
    const std::vector<float> all = random_values(trial == 0 ? 0 : rng() % 300, rng);
    const std::size_t n = all.size();
    // The have partition: pieces dealt to random ranks; every third trial the last rank has none.
    const int dealt = (P > 1 && trial % 3 == 0) ? P - 1 : P;
    std::vector<ConstFlatPiece> have;
    for (const Range& r : random_partition(n, rng() % (3 * P + 1), rng))
      if (static_cast<int>(rng() % dealt) == me) have.push_back({r, all.data() + r.begin});
    // Wants: 0 to 4 random ranges per rank (overlapping, repeated, empty), sometimes everything.
    std::vector<Range> want_ranges;
    for (int s = 0; s < P; ++s) {
      const std::size_t k = rng() % 5;
      for (std::size_t i = 0; i < k; ++i) {
        const Range r = rng() % 4 == 0 ? Range{0, n} : random_range(n, rng);
        if (s == me) want_ranges.push_back(r);
      }
    }
    std::vector<Guarded> bufs;
    for (const Range& r : want_ranges) bufs.emplace_back(r.size());
    std::vector<FlatPiece> want;
    for (std::size_t i = 0; i < want_ranges.size(); ++i)
      want.push_back({want_ranges[i], bufs[i].data()});
    // Tiny stages: many rounds, and per pair and round a single element where stage < ranks.
    const std::size_t stage = trial % 4 == 1 ? kRedistributeStage : 1 + rng() % 12;
    redistribute_pieces(world, n, have, want, stage);
    for (std::size_t i = 0; i < want.size(); ++i) {
      const Range r = want[i].range;
      EXPECT_TRUE(same_bits(want[i].data, all.data() + r.begin, r.size()))
          << "rank " << me << " want [" << r.begin << ", " << r.end << ") of n = " << n
          << ", stage " << stage;
      EXPECT_TRUE(bufs[i].guards_intact())
          << "rank " << me << " wrote outside want [" << r.begin << ", " << r.end << ")";
    }
  }
}

// gather_pieces: random pieces that cover [0, n), overlapping within and across ranks (the same
// values where they overlap, as replicated weights), gathered whole on rank 0 in small rounds.
TEST(RedistributePieces, GatherPiecesTakesOverlapsOnce) {
  MpiComm world(MPI_COMM_WORLD, "world", false);
  const int P = world.size(), me = world.rank();
  const std::uint64_t base = shared_seed();
  for (std::uint64_t trial = 0; trial < 24; ++trial) {
    const std::uint64_t seed = base + trial;
    SCOPED_TRACE(testing::Message() << "trial seed " << seed << " (QT_TEST_SEED=" << base << ")");
    std::mt19937_64 rng(seed);  // every rank draws every rank's pieces alike
    const std::vector<float> all = random_values(trial == 0 ? 0 : rng() % 300, rng);
    const std::size_t n = all.size();
    // A partition dealt to random ranks, then random extra ranges (overlaps) to random ranks.
    std::vector<ConstFlatPiece> have;
    for (const Range& r : random_partition(n, rng() % (3 * P + 1), rng))
      if (static_cast<int>(rng() % P) == me) have.push_back({r, all.data() + r.begin});
    for (std::size_t k = rng() % (2 * P + 1); k > 0; --k) {
      const Range r = random_range(n, rng);
      if (static_cast<int>(rng() % P) == me) have.push_back({r, all.data() + r.begin});
    }
    const std::size_t stage = 1 + rng() % 12;
    std::mt19937_64 local(seed + 1000 * me);  // this rank's piece order (draws differ by rank)
    std::shuffle(have.begin(), have.end(), local);
    Guarded out(me == 0 ? n : 0);
    gather_pieces(world, n, have, out.data(), "the test buffer", stage);
    if (me == 0) {
      EXPECT_TRUE(same_bits(out.data(), all.data(), n)) << "n = " << n;
      EXPECT_TRUE(out.guards_intact());
    }
  }
}

TEST(RedistributePieces, GathersEveryRanksRanges) {
  MpiComm world(MPI_COMM_WORLD, "world", false);
  const int P = world.size(), me = world.rank();
  std::vector<Range> mine;  // rank r passes r ranges (rank 0 none)
  for (int i = 0; i < me; ++i)
    mine.push_back(Range{std::size_t(100 * me + i), std::size_t(100 * me + 2 * i)});
  const auto all = all_gather_ranges(world, mine);
  ASSERT_EQ(all.size(), static_cast<std::size_t>(P));
  for (int s = 0; s < P; ++s) {
    ASSERT_EQ(all[s].size(), static_cast<std::size_t>(s)) << "ranges of rank " << s;
    for (int i = 0; i < s; ++i) {
      EXPECT_EQ(all[s][i].begin, std::size_t(100 * s + i));
      EXPECT_EQ(all[s][i].end, std::size_t(100 * s + 2 * i));
    }
  }
}

TEST(RedistributePieces, PartitionErrorNamesTheFault) {
  using R = std::vector<std::vector<Range>>;
  EXPECT_EQ(partition_error(R{{{4, 12}, {0, 4}}, {}, {{12, 12}, {12, 20}}}, 20), "");
  EXPECT_EQ(partition_error(R{{}, {{0, 0}}}, 0), "");
  EXPECT_EQ(partition_error(R{{{0, 8}}, {{5, 10}}}, 10),
            "elements [5, 8) are held twice: by rank 0 in [0, 8) and by rank 1 in [5, 10)");
  EXPECT_EQ(partition_error(R{{{0, 8}}, {{10, 12}}}, 12),
            "elements [8, 10) of [0, 12) are held by no rank");
  EXPECT_EQ(partition_error(R{{{0, 8}}, {}}, 9), "elements [8, 9) of [0, 9) are held by no rank");
  EXPECT_EQ(partition_error(R{{}, {}, {{3, 5}, {0, 3}, {4, 5}}}, 5),
            "elements [4, 5) are held twice: by rank 2 in [3, 5) and by rank 2 in [4, 5)");
  EXPECT_EQ(partition_error(R{{{0, 8}}, {{8, 11}}}, 10),
            "rank 1 holds [8, 11), which is not a range inside [0, 10)");
  EXPECT_EQ(partition_error(R{{{0, 10}, {6, 3}}}, 10),
            "rank 0 holds [6, 3), which is not a range inside [0, 10)");
}

// ---- checkpoints from pieces ------------------------------------------------------------------

const char* kDeck = "[model]\npreset = custom\n";

// The pieces rank r of P holds in a ZeRO-3 style state: every unit (here each tensor, or each
// decoder layer's tensors together) split evenly over the ranks, rank (r + shift) % P taking
// share r, so that a rank holds one piece per unit.
std::vector<Range> zero_pieces(const ParamLayout& layout, bool per_tensor, int P, int r,
                               int shift) {
  // A decoder layer's tensors share the key "model.layers.N"; any other tensor is its own unit.
  auto unit_of = [&](const std::string& name) {
    const std::string layers = "model.layers.";
    if (per_tensor || name.rfind(layers, 0) != 0) return name;
    return name.substr(0, name.find('.', layers.size()));
  };
  std::vector<Range> units;
  std::string last;
  for (const ParamInfo& p : layout.params()) {
    const std::string unit = unit_of(p.name);
    if (!units.empty() && unit == last)
      units.back().end = p.offset + p.numel;
    else
      units.push_back(Range{p.offset, p.offset + p.numel});
    last = unit;
  }
  std::vector<Range> out;
  for (const Range& u : units) {
    const Range s = split_range(u.size(), P, (r + shift) % P);
    out.push_back(Range{u.begin + s.begin, u.begin + s.end});
  }
  return out;
}

// A rank's state pieces in buffers of their own (as a sharded state holds them).
struct HeldPieces {
  std::vector<Range> ranges;
  std::vector<std::vector<float>> data[3];  // [group][piece]
  std::vector<StatePiece> state_pieces() const {
    std::vector<StatePiece> out;
    for (std::size_t i = 0; i < ranges.size(); ++i)
      out.push_back({ranges[i], data[0][i].data(), data[1][i].data(), data[2][i].data()});
    return out;
  }
};

HeldPieces hold(const State& s, const std::vector<Range>& ranges) {
  HeldPieces h;
  h.ranges = ranges;
  for (int g = 0; g < 3; ++g)
    for (const Range& r : ranges)
      h.data[g].emplace_back(s.group(g).begin() + r.begin, s.group(g).begin() + r.end);
  return h;
}

// Reads `path` into guarded targets of `ranges` (the same for params and both moments) and
// checks every target against `s` bit for bit.
void read_targets_and_compare(const std::string& path, Mesh& mesh, const ModelConfig& m,
                              const State& s, const std::vector<Range>& ranges,
                              const std::string& what) {
  SCOPED_TRACE(what);
  ParamLayout layout(m);
  std::vector<Guarded> bufs[3];
  StateTargets targets;
  std::vector<FlatPiece>* groups[3] = {&targets.params, &targets.exp_avg, &targets.exp_avg_sq};
  for (int g = 0; g < 3; ++g) {
    for (const Range& r : ranges) bufs[g].emplace_back(r.size());
    for (std::size_t i = 0; i < ranges.size(); ++i)
      groups[g]->push_back({ranges[i], bufs[g][i].data()});
  }
  const TrainState st = checkpoint_read(path, mesh, layout, targets, m);
  EXPECT_EQ(st.step, some_state().step);
  EXPECT_EQ(st.rng_counter, some_state().rng_counter);
  for (int g = 0; g < 3; ++g)
    for (std::size_t i = 0; i < ranges.size(); ++i) {
      const Range r = ranges[i];
      EXPECT_TRUE(same_bits(bufs[g][i].data(), s.group(g).data() + r.begin, r.size()))
          << "group " << g << " target [" << r.begin << ", " << r.end << ") differs on rank "
          << world_rank();
      EXPECT_TRUE(bufs[g][i].guards_intact()) << "group " << g << " target [" << r.begin << ", "
                                              << r.end << ") overrun on rank " << world_rank();
    }
}

// Reads with the flat-buffer API: full params, moments of `range`.
void read_flat_and_compare(const std::string& path, Mesh& mesh, const ModelConfig& m,
                           const State& s, Range range) {
  ParamLayout layout(m);
  std::vector<float> p(layout.numel(), -1.0f), ea(range.size(), -1.0f), eas(range.size(), -1.0f);
  checkpoint_read(path, mesh, layout, p.data(), MomentShard{range, ea.data(), eas.data()}, m);
  EXPECT_TRUE(same_bits(p.data(), s.params.data(), p.size())) << "params on rank " << world_rank();
  EXPECT_TRUE(same_bits(ea.data(), s.exp_avg.data() + range.begin, ea.size()));
  EXPECT_TRUE(same_bits(eas.data(), s.exp_avg_sq.data() + range.begin, eas.size()));
}

// A mesh over the first k ranks of the world (nullptr on the others).
class CheckpointPieces : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string d;
    if (world_rank() == 0) {
      char tmpl[] = "ckpt_pieces_XXXXXX";
      ASSERT_NE(mkdtemp(tmpl), nullptr);
      d = fs::absolute(tmpl).string();
    }
    dir_ = bcast_string(d);
    MeshShape shape;
    shape.dp = world_size();
    mesh_ =
        std::make_unique<Mesh>(shape, std::make_shared<MpiComm>(MPI_COMM_WORLD, "world", false));
    n_ = ParamLayout(m_).numel();
    s_ = random_state(n_, shared_seed());
  }
  void TearDown() override {
    barrier();
    if (world_rank() == 0) fs::remove_all(dir_);
  }
  void write_pieces(const std::string& path, Mesh& mesh, const std::vector<Range>& ranges) {
    const HeldPieces h = hold(s_, ranges);
    checkpoint_write(path, mesh, ParamLayout(m_), h.state_pieces(), some_state(), m_, kDeck);
  }

  std::string dir_;
  std::unique_ptr<Mesh> mesh_;
  ModelConfig m_ = odd_model();
  std::size_t n_ = 0;
  State s_;
};

TEST_F(CheckpointPieces, ZeroPartitionRoundTripsIntoAnyTargets) {
  const ParamLayout layout(m_);
  const int P = world_size(), r = world_rank();
  const std::string path = checkpoint_path(dir_, 1);
  const auto per_tensor = zero_pieces(layout, true, P, r, 0);
  ASSERT_EQ(per_tensor.size(), layout.params().size());
  // Units: the embedding, each layer, the final norm, lm_head.
  ASSERT_EQ(zero_pieces(layout, false, P, r, 0).size(),
            static_cast<std::size_t>(m_.num_layers + 3));
  write_pieces(path, *mesh_, per_tensor);
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  read_flat_and_compare(path, *mesh_, m_, s_, Range{0, n_});
  read_targets_and_compare(path, *mesh_, m_, s_, {Range{0, n_}}, "full buffer on every rank");
  read_targets_and_compare(path, *mesh_, m_, s_, per_tensor, "the written partition");
  read_targets_and_compare(path, *mesh_, m_, s_, zero_pieces(layout, false, P, r, 1),
                           "per-layer units, ranks shifted");
  std::mt19937_64 rng(shared_seed() + 7);
  std::vector<Range> any;  // overlapping, repeated and empty ranges, different on every rank
  for (int s = 0; s < P; ++s)
    for (int i = 0; i < 5; ++i) {
      const Range x = random_range(n_, rng);
      if (s == r) any.push_back(x);
    }
  any.push_back(any.front());
  any.push_back(Range{n_, n_});
  read_targets_and_compare(path, *mesh_, m_, s_, any, "random ranges");
  read_targets_and_compare(path, *mesh_, m_, s_, {}, "no targets");

  // Per-layer units, ranks shifted, written; read as per-tensor shards.
  const std::string path2 = checkpoint_path(dir_, 2);
  write_pieces(path2, *mesh_, zero_pieces(layout, false, P, r, 1));
  read_targets_and_compare(path2, *mesh_, m_, s_, per_tensor,
                           "per-tensor shards of per-layer units");
  read_flat_and_compare(path2, *mesh_, m_, s_, split_range(n_, P, r));
}

TEST_F(CheckpointPieces, LoadAcrossWorldSizes) {
  const ParamLayout layout(m_);
  const int P = world_size(), r = world_rank();
  for (int k = 1; k < P; ++k) {
    // Written by the first k ranks as per-tensor shards, read by the whole world.
    const std::string path = checkpoint_path(dir_, 10 + k);
    if (auto sub = make_mesh(k))
      write_pieces(path, *sub, zero_pieces(layout, true, k, sub->world_rank(), 0));
    barrier();
    read_targets_and_compare(path, *mesh_, m_, s_, zero_pieces(layout, false, P, r, 0),
                             "written by " + std::to_string(k) + " ranks");
  }
  // Written by the world, read by the first k ranks.
  const std::string path = checkpoint_path(dir_, 20);
  write_pieces(path, *mesh_, zero_pieces(layout, false, P, r, P - 1));
  for (int k = 1; k < P; ++k) {
    if (auto sub = make_mesh(k)) {
      read_targets_and_compare(path, *sub, m_, s_,
                               zero_pieces(layout, true, k, sub->world_rank(), 0),
                               "read by " + std::to_string(k) + " ranks");
      read_targets_and_compare(path, *sub, m_, s_, {Range{0, n_}},
                               "full, read by " + std::to_string(k));
    }
    barrier();
  }
}

// A file's bytes.
std::string bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

TEST_F(CheckpointPieces, FlatApiAndPiecesMakeTheSameFile) {
  const ParamLayout layout(m_);
  const int P = world_size(), r = world_rank();
  // The flat API with ZeRO-1 moments, and pieces: the same bytes, each read by the other API.
  const std::string flat = checkpoint_path(dir_, 30), pieces = checkpoint_path(dir_, 31);
  const Range shard = split_range(n_, P, r);
  checkpoint_write(flat, *mesh_, layout, s_.params.data(),
                   MomentShard{shard, const_cast<float*>(s_.exp_avg.data()) + shard.begin,
                               const_cast<float*>(s_.exp_avg_sq.data()) + shard.begin},
                   some_state(), m_, kDeck);
  write_pieces(pieces, *mesh_, zero_pieces(layout, true, P, r, 1));
  read_targets_and_compare(flat, *mesh_, m_, s_, zero_pieces(layout, true, P, r, 0),
                           "flat-API file read by pieces");
  read_flat_and_compare(pieces, *mesh_, m_, s_, Range{0, n_});
  if (r == 0) {
    const std::string a = bytes(flat), b = bytes(pieces);
    EXPECT_GT(a.size(), 3 * 4 * n_);
    EXPECT_TRUE(a == b) << "the files of the flat API and of pieces differ";
  }
}

// The same state written a second apart gives the same bytes: HDF5's object times (to the second,
// on by default) are off, so byte comparisons above never depend on the clock.
TEST_F(CheckpointPieces, SameStateSameBytesAnySecond) {
  const ParamLayout layout(m_);
  const int P = world_size(), r = world_rank();
  const std::string a = checkpoint_path(dir_, 40), b = checkpoint_path(dir_, 41);
  write_pieces(a, *mesh_, zero_pieces(layout, true, P, r, 1));
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  write_pieces(b, *mesh_, zero_pieces(layout, true, P, r, 1));
  if (r == 0) {
    EXPECT_TRUE(bytes(a) == bytes(b)) << "the files differ: object times in the file?";
  }
}

TEST_F(CheckpointPieces, FlatStatePiecesAndTargetsAreTheOldContract) {
  MpiComm& world = mesh_->world();
  const int P = world_size(), r = world_rank();
  std::vector<float> p(n_), ea(n_), eas(n_);
  const Range part = split_range(n_, P, r);
  const MomentShard all{Range{0, n_}, ea.data(), eas.data()};
  const auto pieces = flat_state_pieces(n_, world, p.data(), all);
  ASSERT_EQ(pieces.size(), 1u);
  EXPECT_EQ(pieces[0].range.begin, part.begin);
  EXPECT_EQ(pieces[0].range.end, part.end);
  EXPECT_EQ(pieces[0].params, p.data() + part.begin);
  EXPECT_EQ(pieces[0].exp_avg, ea.data() + part.begin);
  const MomentShard shard{part, ea.data(), eas.data()};  // moments of the shard only
  EXPECT_EQ(flat_state_pieces(n_, world, p.data(), shard)[0].exp_avg_sq, eas.data());
  EXPECT_TRUE(flat_state_pieces(0, world, p.data(), MomentShard{}).empty());
  const StateTargets t = flat_state_targets(n_, p.data(), shard);
  ASSERT_EQ(t.params.size(), 1u);
  EXPECT_EQ(t.params[0].range.end, n_);
  EXPECT_EQ(t.params[0].data, p.data());
  ASSERT_EQ(t.exp_avg_sq.size(), 1u);
  EXPECT_EQ(t.exp_avg_sq[0].range.begin, part.begin);
  EXPECT_EQ(t.exp_avg_sq[0].data, eas.data());
}

TEST_F(CheckpointPieces, NonFiniteValueInOnePieceIsRefusedOnEveryRank) {
  const ParamLayout layout(m_);
  const int P = world_size(), r = world_rank();
  const ParamInfo& k = layout.find("model.layers.1.self_attn.k_proj.weight");
  State bad = s_;
  bad.exp_avg[k.offset + k.numel - 1] = std::numeric_limits<float>::infinity();
  const std::string path = checkpoint_path(dir_ + "/sub", 40);
  const HeldPieces h = hold(bad, zero_pieces(layout, true, P, r, 0));
  std::string msg;
  try {
    checkpoint_write(path, *mesh_, layout, h.state_pieces(), some_state(), m_, kDeck);
  } catch (const NonFiniteState& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("/optim/exp_avg/" + k.name + " holds 1 non-finite value"), std::string::npos)
      << "rank " << r << ": " << msg;
  EXPECT_EQ(bcast_string(msg), msg) << "ranks disagree";
  barrier();
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

}  // namespace
}  // namespace qt
