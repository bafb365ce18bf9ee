// qtrain: `mpirun -np N qtrain [--section.key=value ...] deck.ini`
//         `qtrain export <checkpoint.h5> <dir> [options]`   (HF safetensors; docs/finetune.md)
//         `qtrain prep --tokenizer <dir> --output <file.h5> <in.jsonl>...`   (docs/prep.md)
//         `qtrain generate <checkpoint.h5 | HF dir> --prompt TEXT [options]`  (docs/generate.md)
//         `qtrain plan deck.ini --gpus N --gpu-mem GB`   (GPU memory per ZeRO stage; docs/plan.md)
//         `mpirun -np N qtrain probe [--mib M]`   (topology and link bandwidths; docs/cluster.md)
#include <mpi.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <new>
#include <thread>

#include "dist/probe.h"
#include "generate/generate.h"
#include "hf/export.h"
#include "plan/plan_cmd.h"
#include "prep/prep.h"
#include "qtrain/comm.h"
#include "qtrain/deck.h"
#include "qtrain/error.h"
#include "qtrain/mesh.h"
#include "runtime/process.h"
#include "train/trainer.h"

namespace {

// What `qtrain --help` shows before the deck keys.
constexpr const char* kSubcommands =
    "qtrain trains Qwen3 models from an INI deck; its subcommands prepare data, use the\n"
    "checkpoints and plan GPU memory (`qtrain SUBCOMMAND --help` lists a subcommand's options):\n"
    "  qtrain prep --tokenizer DIR --output FILE.h5 [options] FILE...\n"
    "      JSONL records or plain text -> a token file for data.path (docs/prep.md)\n"
    "  qtrain export <checkpoint.h5> <dir> [--merge] [--base DIR] [options]\n"
    "      a checkpoint -> a Hugging Face model directory, or a LoRA run's -> PEFT adapters\n"
    "      (docs/finetune.md)\n"
    "  qtrain generate <checkpoint.h5 | checkpoint dir | HF dir> --prompt TEXT [options]\n"
    "      text from a model, on the CPU or one GPU (docs/generate.md)\n"
    "  qtrain plan DECK --gpus N --gpu-mem GB [--section.key=value ...]\n"
    "      the GPU memory of the deck's model for each ZeRO stage and offload, and what\n"
    "      fits (docs/plan.md)\n"
    "  mpirun -np N qtrain probe [--mib M] [--iters K] [--device cuda|cpu]\n"
    "      the hosts, GPUs, links and NUMA placement, and the all-reduce bandwidth within\n"
    "      and across hosts as the planner's deck keys (docs/cluster.md)\n"
    "\n"
    "Training:\n";

bool has_flag(int argc, char** argv, const char* flag) {
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], flag) == 0) return true;
  return false;
}

// A first argument that is neither an option, a subcommand nor an existing file, and has no
// '.' or '/' (no deck path looks like that): a mistyped subcommand rather than a missing deck.
bool looks_like_subcommand(int argc, char** argv) {
  if (argc < 2 || argv[1][0] == '-' || std::strpbrk(argv[1], "./") != nullptr) return false;
  std::error_code ec;
  return !std::filesystem::exists(argv[1], ec);
}

// The last resort around a subcommand. A UserError is thrown by every rank alike (agree()): its
// message is kept in `error` for end_together() and the rank returns 2 (the subcommands catch
// their own, print them with their own prefix and return 2). Any other exception was seen by this
// rank alone while the others may wait in a collective: it is reported with rank and host, and
// MPI_Abort ends the whole job with code 2 instead of a hang.
template <class F>
int guarded(std::string& error, F&& f) {
  const char* what = nullptr;
  std::string text;
  try {
    return f();
  } catch (const qt::UserError& e) {
    error = e.what();
    return qt::kExitBadInput;
  } catch (const std::bad_alloc& e) {
    what = "out of memory";
    text = fmt::format("{}; the model or batch needs more host memory than this node has", e.what());
  } catch (const std::exception& e) {
    what = "unexpected error";
    text = e.what();
  }
  std::fprintf(stderr, "qtrain: error on rank %d (%s): %s (%s)\n", qt::world_rank_or_zero(),
               qt::host_name().c_str(), what, text.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, qt::kExitBadInput);
  return qt::kExitBadInput;  // not reached
}

// Seconds a failed rank waits for the others to fail too (QTRAIN_FAILURE_GRACE_S, default 30).
double failure_grace_s() {
  const char* env = std::getenv("QTRAIN_FAILURE_GRACE_S");
  const double s = env ? std::atof(env) : 0.0;
  return s > 0 ? s : 30.0;
}

// A rank that stops with an error checks that every rank stops with it: they meet in a barrier
// on `meet`, a communicator of its own, so that it cannot match a collective the others wait in.
// When they all arrive (errors are agreed on, so they do), rank 0 prints `error` before any rank
// returns. When they do not within the grace time, a rank failed alone and the others wait for it
// for ever: this rank prints its error with its rank and host, and MPI_Abort ends the job with
// code `rc`.
void end_together(MPI_Comm meet, int rc, const std::string& error) {
  int size = 1, rank = 0;
  MPI_Comm_size(meet, &size);
  MPI_Comm_rank(meet, &rank);
  MPI_Request req = MPI_REQUEST_NULL;
  int done = size == 1;
  if (!done) MPI_Ibarrier(meet, &req);
  const auto t0 = std::chrono::steady_clock::now();
  const auto grace = std::chrono::duration<double>(failure_grace_s());
  while (!done && std::chrono::steady_clock::now() - t0 < grace) {
    MPI_Test(&req, &done, MPI_STATUS_IGNORE);
    if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (done) {
    if (rank == 0 && !error.empty()) {
      std::fprintf(stderr, "qtrain: error: %s\n", error.c_str());
      std::fflush(stderr);
      // mpirun (Open MPI 4.1) forwards a rank's stderr asynchronously and, when a rank ends with
      // a nonzero code, ends the job, dropping what it has not forwarded yet: CI lost this line
      // twice. Give it time before any rank exits.
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
    }
    // No rank exits before rank 0 has printed (and waited). Every rank is here, so this barrier
    // cannot hang.
    MPI_Barrier(meet);
    return;
  }
  std::fprintf(stderr,
               "qtrain: error on rank %d (%s): %s; the other ranks did not stop within %g s, so "
               "the job is aborted\n",
               rank, qt::host_name().c_str(),
               error.empty() ? "this rank stopped with an error" : error.c_str(),
               failure_grace_s());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, rc);
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rc = 0;
  {
    auto world = std::make_shared<qt::MpiComm>(MPI_COMM_WORLD, "world", false);
    MPI_Comm meet;  // for end_together() only
    MPI_Comm_dup(MPI_COMM_WORLD, &meet);
    const bool root = world->rank() == 0;
    const std::string sub = argc >= 2 ? argv[1] : "";
    std::string error;
    rc = guarded(error, [&]() -> int {
      if (sub == "export") return qt::export_main(argc - 1, argv + 1, world);
      if (sub == "prep") return qt::prep_main(argc - 1, argv + 1, *world);
      if (sub == "generate") return qt::generate_main(argc - 1, argv + 1, world);
      if (sub == "plan") return qt::plan_main(argc - 1, argv + 1, *world);
      if (sub == "probe") return qt::probe_main(argc - 1, argv + 1, *world);
      if (has_flag(argc, argv, "--help") || has_flag(argc, argv, "-h")) {
        if (root) std::printf("%s%s", kSubcommands, qt::deck_help().c_str());
        return 0;
      }
      if (has_flag(argc, argv, "--version")) {
        if (root) std::printf("qtrain %s\n", QTRAIN_VERSION);
        return 0;
      }
      if (looks_like_subcommand(argc, argv))
        qt::fail_user("(command line): {} is neither a subcommand (prep, export, generate, plan, probe) "
                      "nor a deck file; `qtrain --help` lists both",
                      sub);
      qt::Deck deck = qt::parse_deck(argc, argv, world->size());
      if (root) std::printf("qtrain %s: deck %s\n%s\n", QTRAIN_VERSION, deck.path.c_str(), deck.resolved.c_str());
      qt::Mesh mesh(deck.mesh, world);
      return qt::run_training(deck, mesh);
    });
    if (rc != 0) end_together(meet, rc, error);
    MPI_Comm_free(&meet);
  }
  MPI_Finalize();
  return rc;
}
