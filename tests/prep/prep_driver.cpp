// A stand-alone `qtrain prep` until the qtrain executable has the subcommand:
//   mpirun -np N qtrain_prep_driver --tokenizer DIR --output out.h5 data/*.jsonl
#include <mpi.h>

#include "prep/prep.h"
#include "qtrain/comm.h"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rc = 0;
  {
    qt::MpiComm world(MPI_COMM_WORLD, "world", false);
    rc = qt::prep_main(argc, argv, world);
  }
  MPI_Finalize();
  return rc;
}
