// The output of `qtrain prep`: checking that it may be written, and writing it (the token file
// of docs/data.md) from every rank with MPI-IO.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace qt {
class MpiComm;
}

namespace qt::prep {

// Why `output` cannot be written, or must not be, or "": a directory, a missing or read-only
// directory, or (as `output` or as `output`.tmp, where it is written first) one of the `inputs`
// or a file of the tokenizer `tokenizer` under any spelling or link. Not collective.
std::string output_problem(const std::string& output, const std::vector<std::string>& inputs,
                           const std::string& tokenizer);

// This rank's documents: their tokens and loss mask [tokens.size()] and their lengths.
struct Documents {
  const std::vector<std::int32_t>& tokens;
  const std::vector<std::uint8_t>& mask;
  const std::vector<std::int64_t>& lengths;
};

// Collective: writes every rank's documents, in rank order, to `path`.tmp, then renames it to
// `path`. When a write fails (a full disk), every rank throws the same UserError naming the file
// and the OS error, and no file is left behind (the .tmp is removed).
void write_token_file_parallel(const std::string& path, const Documents& mine, std::int64_t vocab,
                               MpiComm& world);

}  // namespace qt::prep
