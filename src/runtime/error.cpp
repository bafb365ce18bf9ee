#include "qtrain/error.h"
#include "runtime/process.h"

#include <hdf5.h>
#include <mpi.h>
#include <unistd.h>

#include <cstdio>

namespace qt {

std::string host_name() {
  char host[256] = "?";
  gethostname(host, sizeof host - 1);
  return host;
}

int world_rank_or_zero() {
  int init = 0;
  MPI_Initialized(&init);
  int rank = 0;
  if (init) MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

void fatal_one(const char* file, int line, const std::string& msg) {
  std::fprintf(stderr, "qtrain: internal error on rank %d (%s) at %s:%d: %s\n",
               world_rank_or_zero(), host_name().c_str(), file, line, msg.c_str());
  std::fflush(stderr);
  int init = 0;
  MPI_Initialized(&init);
  if (init) MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

void fail_mpi(const char* file, int line, const char* expr, int code) {
  char text[MPI_MAX_ERROR_STRING] = "";
  int len = 0;
  MPI_Error_string(code, text, &len);
  fatal_one(file, line, fmt::format("MPI call failed: {}: {} (code {})", expr, text, code));
}

void fail_hdf5(const char* file, int line, const char* expr) {
  H5Eprint2(H5E_DEFAULT, stderr);
  fatal_one(file, line, fmt::format("HDF5 call failed: {}", expr));
}

}  // namespace qt
