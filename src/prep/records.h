// One JSONL record -> one document of tokens and loss mask (docs/prep.md): {"text"} for
// pretraining, {"messages"} rendered with Qwen3's chat template, {"instruction","input","output"}
// as one user and one assistant turn.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "qtrain/tokenizer.h"

namespace qt::prep {

enum class Format { kAuto, kText, kChat, kInstruction };

// Why a record was not used; kCount is the number of reasons.
enum class Skip { kNone, kMalformed, kInvalid, kUnknownFormat, kEmpty, kTooLong, kCount };
const char* skip_name(Skip s);

struct RecordResult {
  Skip skip = Skip::kNone;
  std::string detail;  // for kMalformed / kInvalid / kUnknownFormat: what is wrong
  bool truncated = false;
  bool repaired = false;  // the record held invalid UTF-8, replaced by U+FFFD
};

class RecordEncoder {
 public:
  // max_tokens = 0: no limit. eos_token ends every text record.
  RecordEncoder(Tokenizer tok, Format format, std::int64_t max_tokens, bool truncate,
                const std::string& eos_token);

  // Appends the document of `line` to tokens/mask, or nothing (and says why). Invalid UTF-8 in
  // the line is replaced by U+FFFD first (as the tokenizer would do to the text).
  RecordResult add(std::string_view line, std::vector<std::int32_t>& tokens,
                   std::vector<std::uint8_t>& mask);

  // A text record given as its text (a {"text"} record's string, or a record of a plain-text
  // file): its tokens, then the eos token, every token in the loss; empty text is kEmpty;
  // invalid UTF-8 is replaced by U+FFFD.
  RecordResult add_text(std::string_view text, std::vector<std::int32_t>& tokens,
                        std::vector<std::uint8_t>& mask);

 private:
  Tokenizer tok_;
  Format format_;
  std::int64_t max_tokens_;
  bool truncate_;
  std::int32_t eos_id_;
  std::vector<std::int32_t> ids_;  // scratch
  std::vector<std::int64_t> starts_;
};

}  // namespace qt::prep
