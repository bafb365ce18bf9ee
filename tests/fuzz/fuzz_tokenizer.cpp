// tokenizer.json loading (src/tokenizer: Tokenizer::from_file, what `qtrain prep` and
// `qtrain generate` read). Input: the file's text. A file may only be refused with a UserError;
// an accepted tokenizer must encode a few texts (its regex may give up on one with a
// std::runtime_error, which prep reports as a record it cannot tokenize) into ids it can decode.
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "qtrain/error.h"
#include "qtrain/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = qt::fuzz::write_scratch(
      "tokenizer.json", std::string_view(reinterpret_cast<const char*>(data), size));
  std::optional<qt::Tokenizer> tok;
  try {
    tok = qt::Tokenizer::from_file(path);
  } catch (const qt::UserError&) {
    return 0;
  }
  const int vocab = tok->vocab_size();
  QT_FUZZ_ASSERT(vocab > 0, "an accepted tokenizer with no ids");
  const std::string texts[] = {"Hello world, it's 2024!  \n\tdone",
                               "<|im_start|>user\nx<|im_end|>\n",
                               "caf\xC3\xA9 e\xCC\x81 \xE4\xB8\xAD\xE6\x96\x87 \xF0\x9F\x98\x80",
                               "\xFF\xC3 bad utf-8 \xE2\x82", std::string(300, 'a')};
  for (const std::string& text : texts) {
    for (bool special : {true, false}) {
      std::vector<std::int32_t> ids;
      std::vector<std::int64_t> starts;
      try {
        tok->encode_append(text, ids, &starts, special);
      } catch (const qt::UserError&) {
        QT_FUZZ_ASSERT(false, "encode threw a UserError after a successful load");
      } catch (const std::runtime_error&) {
        continue;  // the pre-tokenizer regex hit its match limit
      }
      QT_FUZZ_ASSERT(starts.size() == ids.size(), "one start offset per token");
      for (std::size_t k = 0; k < ids.size(); ++k) {
        QT_FUZZ_ASSERT(ids[k] >= 0 && ids[k] < vocab, "an id outside the vocabulary");
        QT_FUZZ_ASSERT(starts[k] >= 0 && (k == 0 || starts[k] >= starts[k - 1]),
                       "start offsets must not decrease");
      }
      try {
        (void)tok->decode(ids);  // every id encode gives names a token
      } catch (const qt::UserError& e) {
        QT_FUZZ_ASSERT(false, std::string("decode of encode's ids failed: ") + e.what());
      }
    }
  }
  return 0;
}
