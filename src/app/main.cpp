// qtrain: `mpirun -np N qtrain [--section.key=value ...] deck.ini`
//         `qtrain export <checkpoint.h5> <dir> [options]`   (HF safetensors; docs/finetune.md)
//         `qtrain prep --tokenizer <dir> --output <file.h5> <in.jsonl>...`   (docs/prep.md)
//         `qtrain generate <checkpoint.h5 | HF dir> --prompt TEXT [options]`  (docs/generate.md)
#include <mpi.h>

#include <cstdio>
#include <cstring>
#include <memory>

#include "generate/generate.h"
#include "hf/export.h"
#include "prep/prep.h"
#include "qtrain/comm.h"
#include "qtrain/deck.h"
#include "qtrain/error.h"
#include "qtrain/mesh.h"
#include "train/trainer.h"

namespace {

bool has_flag(int argc, char** argv, const char* flag) {
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], flag) == 0) return true;
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rc = 0;
  {
    auto world = std::make_shared<qt::MpiComm>(MPI_COMM_WORLD, "world", false);
    const bool root = world->rank() == 0;
    if (argc >= 2 && std::strcmp(argv[1], "export") == 0) {
      rc = qt::export_main(argc - 1, argv + 1, world);
    } else if (argc >= 2 && std::strcmp(argv[1], "prep") == 0) {
      rc = qt::prep_main(argc - 1, argv + 1, *world);
    } else if (argc >= 2 && std::strcmp(argv[1], "generate") == 0) {
      rc = qt::generate_main(argc - 1, argv + 1, world);
    } else if (has_flag(argc, argv, "--help") || has_flag(argc, argv, "-h")) {
      if (root) std::printf("%s", qt::deck_help().c_str());
    } else if (has_flag(argc, argv, "--version")) {
      if (root) std::printf("qtrain %s\n", QTRAIN_VERSION);
    } else {
      try {
        qt::Deck deck = qt::parse_deck(argc, argv, world->size());
        if (root) std::printf("qtrain %s: deck %s\n%s\n", QTRAIN_VERSION, deck.path.c_str(), deck.resolved.c_str());
        qt::Mesh mesh(deck.mesh, world);
        rc = qt::run_training(deck, mesh);
      } catch (const qt::UserError& e) {
        if (root) std::fprintf(stderr, "qtrain: error: %s\n", e.what());
        rc = qt::kExitBadInput;
      }
    }
  }
  MPI_Finalize();
  return rc;
}
