// `qtrain prep`: JSONL records -> the engine's token file (include/qtrain/data.h), under MPI.
// docs/prep.md describes the options, the record forms and the loss-mask rule.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace qt {

class MpiComm;

// What a run did (for tests; the same numbers are printed by rank 0).
struct PrepStats {
  std::int64_t records = 0, documents = 0, tokens = 0, trained = 0, truncated = 0;
  std::int64_t repaired = 0;          // documents whose invalid UTF-8 became U+FFFD
  std::vector<std::int64_t> skipped;  // by prep::Skip (index 0 unused)
  std::vector<std::string> examples;  // "file:line: reason: detail" of the first problems (rank 0)
};

// argv[0] is the subcommand's name ("prep"), then options and input files. Collective over
// `world`. Returns the exit code: 0, or 2 (kExitBadInput) after rank 0 printed what is wrong
// (bad option, missing input file, nothing usable).
// `stats`, if given, receives the totals on every rank.
int prep_main(int argc, char** argv, MpiComm& world, PrepStats* stats = nullptr);

}  // namespace qt
