// MPI_COMM_WORLD helpers shared by the tests that run under mpiexec.
#pragma once

#include <mpi.h>

#include <cstring>
#include <memory>
#include <string>

#include "qtrain/comm.h"
#include "qtrain/mesh.h"

namespace qt::test {

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

inline int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

inline void barrier() { MPI_Barrier(MPI_COMM_WORLD); }

// Rank 0's string, on every rank.
inline std::string bcast_string(std::string s) {
  int n = static_cast<int>(s.size());
  MPI_Bcast(&n, 1, MPI_INT, 0, MPI_COMM_WORLD);
  s.resize(n);
  MPI_Bcast(s.data(), n, MPI_CHAR, 0, MPI_COMM_WORLD);
  return s;
}

// A dp-only mesh of the first k world ranks; null on the other ranks. Collective over the world.
inline std::unique_ptr<Mesh> make_mesh(int k) {
  const int r = world_rank();
  MPI_Comm sub = MPI_COMM_NULL;
  MPI_Comm_split(MPI_COMM_WORLD, r < k ? 0 : MPI_UNDEFINED, r, &sub);
  if (sub == MPI_COMM_NULL) return nullptr;
  MeshShape shape;
  shape.dp = k;
  return std::make_unique<Mesh>(shape, std::make_shared<MpiComm>(sub, "world", true));
}

inline bool same_bits(const float* a, const float* b, std::size_t n) {
  return n == 0 || std::memcmp(a, b, n * sizeof(float)) == 0;
}

}  // namespace qt::test
