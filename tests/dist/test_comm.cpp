// The MPI communicator and the mesh, run under mpiexec -n 4.
#include <gtest/gtest.h>
#include <mpi.h>

#include <memory>
#include <numeric>
#include <set>

#include "dist/probe.h"
#include "qtrain/comm.h"
#include "qtrain/error.h"
#include "qtrain/mesh.h"

namespace qt {
namespace {

std::shared_ptr<MpiComm> world() {
  return std::make_shared<MpiComm>(MPI_COMM_WORLD, "world", false);
}

// world = pp x dp x cp x tp: cp sits between tp (inside it) and dp.
TEST(MeshArithmetic, ContextParallelIsBetweenTpAndDp) {
  MeshShape s{2, 2, 2, 1};
  s.cp = 3;
  EXPECT_EQ(s.world(), 24);
  EXPECT_EQ(s.dp_cp(), 6);
  std::set<std::tuple<int, int, int, int>> seen;
  for (int r = 0; r < s.world(); ++r) {
    const MeshCoord c = mesh_coord_of(s, r);
    EXPECT_EQ(mesh_rank_of(s, c), r);
    EXPECT_EQ(c.tp, r % 2);
    EXPECT_EQ(c.cp, (r / 2) % 3);
    EXPECT_EQ(c.dp, (r / 6) % 2);
    EXPECT_EQ(c.pp, r / 12);
    EXPECT_TRUE(seen.insert({c.pp, c.dp, c.cp, c.tp}).second);
  }
}

TEST(MeshArithmetic, CoordinatesRoundTripAndTpIsInnermost) {
  for (MeshShape s : {MeshShape{2, 2, 2, 1}, MeshShape{4, 1, 1, 2}, MeshShape{3, 2, 1, 3},
                      MeshShape{1, 1, 1, 1}, MeshShape{8, 1, 2, 4}}) {
    std::set<std::tuple<int, int, int>> seen;
    for (int r = 0; r < s.world(); ++r) {
      MeshCoord c = mesh_coord_of(s, r);
      EXPECT_EQ(mesh_rank_of(s, c), r);
      EXPECT_EQ(c.dp, c.edp * s.ep + c.ep);
      EXPECT_TRUE(seen.insert({c.pp, c.dp, c.tp}).second);
    }
    if (s.tp > 1) EXPECT_EQ(mesh_coord_of(s, 1).tp, 1);                 // neighbours share dp
    if (s.pp > 1) EXPECT_EQ(mesh_coord_of(s, s.world() - 1).pp, s.pp - 1);  // pp outermost
  }
}

// Tensor-parallel groups are tp consecutive world ranks; a group on two hosts is named.
TEST(MeshArithmetic, TensorParallelGroupsAcrossHostsAreNamed) {
  MeshShape s;
  s.tp = 4;
  s.dp = 2;
  const std::vector<std::string> two_by_four = {"a", "a", "a", "a", "b", "b", "b", "b"};
  EXPECT_TRUE(tp_groups_across_hosts(s, two_by_four).empty());
  const std::vector<std::string> four_by_two = {"a", "a", "b", "b", "c", "c", "d", "d"};
  const std::vector<std::string> got = tp_groups_across_hosts(s, four_by_two);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0], "world ranks 0..3 on hosts a, b");
  EXPECT_EQ(got[1], "world ranks 4..7 on hosts c, d");
  s.tp = 1;
  EXPECT_TRUE(tp_groups_across_hosts(s, four_by_two).empty());
}

// One warning line names mesh.tp and the ranks per host, or the round-robin placement.
TEST(MeshArithmetic, TensorParallelAcrossHostsWarningNamesTheKeys) {
  MeshShape s;
  s.tp = 8;
  s.dp = 3;
  std::vector<std::string> six_a_host;  // 4 hosts of 6 ranks: groups 0..7 and 8..15 cross
  for (int r = 0; r < 24; ++r) six_a_host.push_back(std::string(1, static_cast<char>('a' + r / 6)));
  const std::string w = tp_across_hosts_warning(s, six_a_host);
  EXPECT_EQ(w.rfind("warning: mesh.tp = 8 puts 3 of 3 tensor-parallel groups across hosts (first: "
                    "world ranks 0..7 on hosts a, b): the ranks per host (6) are not a multiple of "
                    "mesh.tp;", 0), 0u) << w;
  s.dp = 4;
  std::vector<std::string> blocks, dealt;  // 4 hosts of 8: host by host, or round robin
  for (int r = 0; r < 32; ++r) {
    blocks.push_back(std::string(1, static_cast<char>('a' + r / 8)));
    dealt.push_back(std::string(1, static_cast<char>('a' + r % 4)));
  }
  EXPECT_EQ(tp_across_hosts_warning(s, blocks), "");
  const std::string d = tp_across_hosts_warning(s, dealt);
  EXPECT_NE(d.find("4 of 4 tensor-parallel groups"), std::string::npos) << d;
  EXPECT_NE(d.find("the ranks are not placed host by host"), std::string::npos) << d;
  s.tp = 1;
  EXPECT_EQ(tp_across_hosts_warning(s, dealt), "");
}

TEST(MpiComm, Collectives) {
  auto w = world();
  const int n = w->size(), r = w->rank();
  // all_reduce
  std::vector<double> v = {1.0 * r, 2.0};
  w->all_reduce(v.data(), v.size(), DType::kF64, ReduceOp::kSum);
  EXPECT_EQ(v[0], n * (n - 1) / 2.0);
  EXPECT_EQ(v[1], 2.0 * n);
  EXPECT_EQ(w->max(static_cast<double>(r)), n - 1);
  // reduce_scatter: block b of rank q holds q + b; rank r receives sum_q (q + r)
  std::vector<float> send(3 * n), recv(3);
  for (int b = 0; b < n; ++b)
    for (int i = 0; i < 3; ++i) send[b * 3 + i] = static_cast<float>(r + b + i);
  w->reduce_scatter(send.data(), recv.data(), 3, DType::kF32, ReduceOp::kSum);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(recv[i], n * (n - 1) / 2.0f + n * (r + i));
  // all_gather
  std::vector<std::int64_t> mine = {r, 10 * r}, all(2 * n);
  w->all_gather(mine.data(), all.data(), 2, DType::kI64);
  for (int q = 0; q < n; ++q) {
    EXPECT_EQ(all[2 * q], q);
    EXPECT_EQ(all[2 * q + 1], 10 * q);
  }
  // all_gather in place: each rank's block already at its position in recv
  std::vector<float> gathered(2 * n, -1.0f);
  gathered[2 * r] = 0.5f * r;
  gathered[2 * r + 1] = 7.0f;
  w->all_gather(gathered.data() + 2 * r, gathered.data(), 2, DType::kF32);
  for (int q = 0; q < n; ++q) {
    EXPECT_EQ(gathered[2 * q], 0.5f * q);
    EXPECT_EQ(gathered[2 * q + 1], 7.0f);
  }
  // all_to_all_v: rank r sends q + 1 copies of value 100 r + q to rank q
  std::vector<std::size_t> sc(n), sd(n), rc(n), rd(n);
  std::vector<std::int32_t> out, in;
  for (int q = 0; q < n; ++q) {
    sd[q] = out.size();
    sc[q] = q + 1;
    for (int k = 0; k <= q; ++k) out.push_back(100 * r + q);
    rd[q] = q == 0 ? 0 : rd[q - 1] + rc[q - 1];
    rc[q] = r + 1;
  }
  in.resize(rd[n - 1] + rc[n - 1]);
  w->all_to_all_v(out.data(), sc, sd, in.data(), rc, rd, DType::kI32);
  for (int q = 0; q < n; ++q)
    for (std::size_t k = 0; k < rc[q]; ++k) EXPECT_EQ(in[rd[q] + k], 100 * q + r);
  // broadcast
  std::int32_t b = r == n - 1 ? 77 : -1;
  w->broadcast(&b, 1, DType::kI32, n - 1);
  EXPECT_EQ(b, 77);
  // ring send/recv (even ranks send first to avoid a cycle of blocking sends)
  if (n > 1) {
    float token = static_cast<float>(r), got = -1;
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    if (r % 2 == 0) {
      w->send(&token, 1, DType::kF32, next, 5);
      w->recv(&got, 1, DType::kF32, prev, 5);
    } else {
      w->recv(&got, 1, DType::kF32, prev, 5);
      w->send(&token, 1, DType::kF32, next, 5);
    }
    EXPECT_EQ(got, static_cast<float>(prev));
  }
  w->barrier();
}

// Each call is counted by kind with NCCL-tests sizes and bus factors; a take starts again.
TEST(MpiComm, TakeTimesCountsEachCallBySizeAndBusFactor) {
  MpiComm w(MPI_COMM_WORLD, "timed", false);
  const int n = w.size();
  std::vector<float> buf(1000 * n, 1.0f), out(1000 * n);
  w.all_reduce(buf.data(), 1000, DType::kF32, ReduceOp::kSum);
  w.all_reduce(buf.data(), 500, DType::kF32, ReduceOp::kSum);
  w.reduce_scatter(buf.data(), out.data(), 1000, DType::kF32, ReduceOp::kSum);
  w.all_gather(buf.data(), out.data(), 1000, DType::kF32);
  CollectiveTimes t = w.take_times();
  const auto at = [&](CollectiveKind k) { return t[static_cast<std::size_t>(k)]; };
  const double ring = (n - 1.0) / n;
  EXPECT_EQ(at(CollectiveKind::kAllReduce).calls, 2);
  EXPECT_EQ(at(CollectiveKind::kAllReduce).bytes, 6000);
  EXPECT_DOUBLE_EQ(at(CollectiveKind::kAllReduce).bus_bytes, 6000 * 2 * ring);
  EXPECT_GT(at(CollectiveKind::kAllReduce).seconds, 0);
  EXPECT_EQ(at(CollectiveKind::kReduceScatter).bytes, 4000.0 * n);  // the whole input
  EXPECT_DOUBLE_EQ(at(CollectiveKind::kReduceScatter).bus_bytes, 4000.0 * n * ring);
  EXPECT_EQ(at(CollectiveKind::kAllGather).bytes, 4000.0 * n);  // the whole output
  EXPECT_EQ(at(CollectiveKind::kAllToAll).calls, 0);
  EXPECT_STREQ(collective_kind_name(CollectiveKind::kPointToPoint), "send_recv");
  t = w.take_times();
  EXPECT_EQ(at(CollectiveKind::kAllReduce).calls, 0);  // counted from the last take
}

TEST(Mesh, CommunicatorsGroupTheRightRanks) {
  auto w = world();
  if (w->size() != 4) GTEST_SKIP() << "needs 4 ranks";
  // pp 1 x dp 2 x tp 2, ep 2: tp pairs {0,1},{2,3}; dp pairs {0,2},{1,3}.
  Mesh mesh(MeshShape{2, 2, 1, 2}, w);
  const int r = w->rank();
  EXPECT_EQ(mesh.tp().size(), 2);
  EXPECT_EQ(mesh.dp().size(), 2);
  EXPECT_EQ(mesh.pp().size(), 1);
  EXPECT_EQ(mesh.ep().size(), 2);
  EXPECT_EQ(mesh.edp().size(), 1);
  EXPECT_EQ(mesh.tp().rank(), r % 2);
  EXPECT_EQ(mesh.dp().rank(), r / 2);
  // Sum of world ranks inside each group identifies its members.
  EXPECT_EQ(mesh.tp().sum(static_cast<double>(r)), r < 2 ? 1.0 : 5.0);
  EXPECT_EQ(mesh.dp().sum(static_cast<double>(r)), r % 2 == 0 ? 2.0 : 4.0);
  EXPECT_EQ(mesh.local_size(), 4);  // one node
  const std::string text = mesh.describe();
  if (r == 0) {
    EXPECT_NE(text.find("dp 2"), std::string::npos) << text;
    EXPECT_NE(text.find("topology: 1 host, 4 ranks\n"), std::string::npos) << text;
    EXPECT_NE(text.find("local ranks 0-3: CPUs"), std::string::npos) << text;  // one NUMA node here
    EXPECT_EQ(text.find("GPU"), std::string::npos) << text;  // not asked for
    EXPECT_EQ(text.find("warning"), std::string::npos) << text;
  } else {
    EXPECT_EQ(text, "");
  }
  // Each dimension by name: the same communicators as the accessors.
  EXPECT_EQ(&mesh.mpi(MeshDim::kDp), &mesh.dp());
  EXPECT_EQ(&mesh.mpi(MeshDim::kTp), &mesh.tp());
  EXPECT_EQ(&mesh.mpi(MeshDim::kPp), &mesh.pp());
  EXPECT_EQ(&mesh.mpi(MeshDim::kEp), &mesh.ep());
  EXPECT_EQ(&mesh.mpi(MeshDim::kEdp), &mesh.edp());
  EXPECT_STREQ(mesh_dim_name(MeshDim::kEdp), "edp");
  // Without context parallelism the cp groups are single ranks and dp x cp is dp.
  EXPECT_EQ(mesh.cp().size(), 1);
  EXPECT_EQ(mesh.dp_cp().size(), 2);
  EXPECT_EQ(mesh.dp_cp().sum(static_cast<double>(r)), r % 2 == 0 ? 2.0 : 4.0);
#ifndef QTRAIN_HAVE_CUDA
  // Device communicators need the CUDA build: a clear error, not a crash.
  try {
    mesh.device(MeshDim::kDp);
    ADD_FAILURE() << "expected a UserError";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("needs the CUDA back end"), std::string::npos) << e.what();
  }
#endif
}

// pp 1 x dp 2 x cp 2 x tp 1: cp pairs {0,1},{2,3} (inside dp); dp pairs {0,2},{1,3}; all four
// ranks reduce the gradients together (dp x cp, in the order dp_idx x cp + cp_idx).
TEST(Mesh, ContextParallelGroups) {
  auto w = world();
  if (w->size() != 4) GTEST_SKIP() << "needs 4 ranks";
  MeshShape s;
  s.dp = 2;
  s.cp = 2;
  Mesh mesh(s, w);
  const int r = w->rank();
  EXPECT_EQ(mesh.coord().cp, r % 2);
  EXPECT_EQ(mesh.coord().dp, r / 2);
  EXPECT_EQ(mesh.cp().rank(), r % 2);
  EXPECT_EQ(mesh.cp().sum(static_cast<double>(r)), r < 2 ? 1.0 : 5.0);
  EXPECT_EQ(mesh.dp().sum(static_cast<double>(r)), r % 2 == 0 ? 2.0 : 4.0);
  EXPECT_EQ(mesh.dp_cp().size(), 4);
  EXPECT_EQ(mesh.dp_cp().rank(), r);
  EXPECT_EQ(mesh.tp().size(), 1);
  EXPECT_EQ(mesh.edp().size(), 2);  // ep 1: the dp group
  EXPECT_EQ(&mesh.mpi(MeshDim::kCp), &mesh.cp());
  EXPECT_EQ(&mesh.mpi(MeshDim::kDpCp), &mesh.dp_cp());
  EXPECT_STREQ(mesh_dim_name(MeshDim::kDpCp), "dpcp");
  const std::string text = mesh.describe();
  if (r == 0)
    EXPECT_NE(text.find("world 4 = pp 1 x dp 2 x cp 2 x tp 1"), std::string::npos) << text;
}

// The probe's timing on two fake hosts of two ranks: "within a host" pairs {0,1}, {2,3}, "across
// hosts" pairs {0,2}, {1,3}; every rank of a group gets the group's slowest time.
TEST(Probe, TimesEachGroupAtOnce) {
  auto w = world();
  if (w->size() != 4) GTEST_SKIP() << "needs 4 ranks";
  const int r = w->rank();
  MPI_Comm a, b;
  ASSERT_EQ(MPI_Comm_split(MPI_COMM_WORLD, r / 2, r, &a), MPI_SUCCESS);
  ASSERT_EQ(MPI_Comm_split(MPI_COMM_WORLD, r % 2, r, &b), MPI_SUCCESS);
  MpiComm host(a, "host", true), across(b, "across hosts", true);
  for (MpiComm* g : {&host, &across}) {
    std::vector<float> buf(1 << 16, 1.0f);
    const double s = time_all_reduce(*g, *g, buf.data(), buf.size(), 1, 3);
    EXPECT_GT(s, 0.0);
    EXPECT_EQ(g->max(s), s);  // the same on both ranks of the group
    EXPECT_EQ(buf[0], 16.0f);  // 1 + 3 sums of two ranks: 2^4
    EXPECT_GT(all_reduce_bus_gbps(buf.size() * sizeof(float), g->size(), s), 0.0);
  }
}

}  // namespace
}  // namespace qt
