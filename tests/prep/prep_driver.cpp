// A stand-alone `qtrain prep` until the qtrain executable has the subcommand:
//   mpirun -np N qtrain_prep_driver --tokenizer DIR --output out.h5 data/*.jsonl
// For tests of a full disk, QT_TEST_FILE_SIZE_LIMIT=BYTES limits the size of the files that the
// ranks write (RLIMIT_FSIZE, set after MPI_Init so that MPI's own shared-memory files are not
// limited), with SIGXFSZ ignored: a write past the limit then fails with EFBIG as a write to a
// full disk fails with ENOSPC.
#include <mpi.h>
#include <sys/resource.h>

#include <csignal>
#include <cstdlib>

#include "prep/prep.h"
#include "qtrain/comm.h"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  if (const char* limit = std::getenv("QT_TEST_FILE_SIZE_LIMIT")) {
    std::signal(SIGXFSZ, SIG_IGN);
    const rlim_t bytes = std::strtoull(limit, nullptr, 10);
    const rlimit r{bytes, bytes};
    if (setrlimit(RLIMIT_FSIZE, &r) != 0) MPI_Abort(MPI_COMM_WORLD, 3);
  }
  int rc = 0;
  {
    qt::MpiComm world(MPI_COMM_WORLD, "world", false);
    rc = qt::prep_main(argc, argv, world);
  }
  MPI_Finalize();
  return rc;
}
