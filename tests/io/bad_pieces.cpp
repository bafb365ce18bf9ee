// bad_pieces MODE PATH: every rank writes a checkpoint of a small model to PATH from pieces that
// overlap (MODE overlap: rank 0's piece reaches 3 elements into rank 1's) or leave a gap (MODE
// gap: the last rank's piece stops 5 elements short of the end). checkpoint_write must fail its
// cover check on every rank before anything is written (expect_abort.sh checks the message and
// that no file is left); should it return, this prints "written" and exits 0.
#include <mpi.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "qtrain/checkpoint.h"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const std::string mode = argc == 3 ? argv[1] : "";
  if (mode != "overlap" && mode != "gap") {
    std::fprintf(stderr, "usage: bad_pieces overlap|gap PATH\n");
    MPI_Finalize();
    return 64;
  }
  auto world = std::make_shared<qt::MpiComm>(MPI_COMM_WORLD, "world", false);
  qt::MeshShape shape;
  shape.dp = world->size();
  qt::Mesh mesh(shape, world);
  qt::ModelConfig m;
  m.preset = "custom";
  m.vocab_size = 37;
  m.hidden_size = 12;
  m.intermediate_size = 20;
  m.num_layers = 1;
  m.num_heads = 2;
  m.num_kv_heads = 1;
  m.head_dim = 6;
  const qt::ParamLayout layout(m);
  const std::size_t n = layout.numel();
  std::vector<float> zeros(n, 0.0f);
  qt::Range r = qt::split_range(n, world->size(), world->rank());
  if (mode == "overlap" && world->rank() == 0) r.end += 3;
  if (mode == "gap" && world->rank() == world->size() - 1) r.end -= 5;
  const std::vector<qt::StatePiece> pieces = {
      {r, zeros.data() + r.begin, zeros.data() + r.begin, zeros.data() + r.begin}};
  qt::checkpoint_write(argv[2], mesh, layout, pieces, qt::TrainState{}, m, "");
  std::printf("written\n");
  MPI_Finalize();
  return 0;
}
