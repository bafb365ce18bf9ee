// The JSONL record reader of `qtrain prep` (src/prep/records.*: RecordEncoder::add, with the chat
// template of src/prep/chat.*), over a small Qwen3-style tokenizer (tests/fuzz/
// tokenizer_small.json: byte-level BPE, Qwen3's split regex, NFC, the chat's added tokens).
// Input: one byte of settings (format, token limit, truncation), then JSONL lines. A line may
// only be used or skipped with a reason; a used one appends as many mask bytes as tokens, every
// id inside the vocabulary, at least one trained token, and no more than the limit.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "prep/records.h"
#include "qtrain/error.h"
#include "qtrain/tokenizer.h"

namespace {

const qt::Tokenizer& tokenizer() {
  static const qt::Tokenizer tok = qt::Tokenizer::from_file(QT_FUZZ_TOKENIZER);
  return tok;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using qt::prep::Format;
  using qt::prep::Skip;
  qt::fuzz::Bytes in(data, size);
  const std::uint8_t settings = in.u8();
  const Format format = static_cast<Format>(settings & 3);
  const std::int64_t max_tokens =
      (settings >> 2) & 7 ? std::int64_t{1} << ((settings >> 2) & 7) : 0;
  const bool truncate = (settings & 0x20) != 0;
  const qt::Tokenizer& tok = tokenizer();
  qt::prep::RecordEncoder enc(tok, format, max_tokens, truncate, "<|endoftext|>");
  std::vector<std::int32_t> tokens;
  std::vector<std::uint8_t> mask;
  while (in.left() > 0) {
    const std::string_view line = in.until('\n');
    const std::size_t before = tokens.size();
    qt::prep::RecordResult r;
    try {
      r = enc.add(line, tokens, mask);
    } catch (const qt::UserError& e) {
      QT_FUZZ_ASSERT(false, std::string("a record raised a UserError: ") + e.what());
    }
    QT_FUZZ_ASSERT(tokens.size() == mask.size(), "tokens and mask differ in length");
    const std::size_t added = tokens.size() - before;
    if (r.skip != Skip::kNone) {
      QT_FUZZ_ASSERT(added == 0,
                     std::string("a skipped record left tokens: ") + qt::prep::skip_name(r.skip));
      continue;
    }
    QT_FUZZ_ASSERT(added > 0, "a used record of no tokens");
    QT_FUZZ_ASSERT(max_tokens == 0 || static_cast<std::int64_t>(added) <= max_tokens,
                   "a used record longer than the token limit");
    std::size_t trained = 0;
    for (std::size_t k = before; k < tokens.size(); ++k) {
      QT_FUZZ_ASSERT(tokens[k] >= 0 && tokens[k] < tok.vocab_size(),
                     "an id outside the vocabulary");
      QT_FUZZ_ASSERT(mask[k] <= 1, "a mask byte other than 0 or 1");
      trained += mask[k];
    }
    QT_FUZZ_ASSERT(trained > 0, "a used record with no trained token");
  }
  return 0;
}
