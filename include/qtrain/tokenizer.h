// Byte-level BPE tokenizer reading a Hugging Face tokenizer.json (Qwen2/Qwen3, GPT-2 style).
//
// encode(text) gives the ids that transformers' tokenizer(text, add_special_tokens=False) gives:
//   1. invalid UTF-8 is replaced by U+FFFD (one per maximal ill-formed subpart, as Python's
//      bytes.decode("utf-8", "replace") does);
//   2. added tokens (<|im_start|>, <think>, ...) are split out of the text first, leftmost-longest;
//      special ones only when parse_special is true (transformers' split_special_tokens=False);
//   3. each remaining segment is NFC-normalised, split by the pre-tokenizer regex (PCRE2, Unicode
//      classes; \s as Oniguruma defines it), mapped to byte-level characters and merged by BPE.
// decode(ids) concatenates the tokens' bytes (raw bytes: a cut inside a UTF-8 sequence stays cut;
// transformers would show U+FFFD there). docs/tokenizer.md has the details.
//
// A Tokenizer is cheap to copy (shared state) and safe to use from several threads.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace qt {

class Tokenizer {
 public:
  // Reads a tokenizer.json; throws UserError naming the file and the problem.
  static Tokenizer from_file(const std::string& tokenizer_json);
  // `path` is a directory holding tokenizer.json (and optionally tokenizer_config.json, whose
  // chat_template and eos_token are kept), or a tokenizer.json file itself.
  static Tokenizer from_dir(const std::string& path);

  std::vector<std::int32_t> encode(std::string_view text, bool parse_special = true) const;
  // Appends the ids of `text` to `ids` and, if `starts` is given, the byte offset in `text` of
  // each token's first byte (exact for valid UTF-8 that NFC leaves unchanged; inside a segment
  // that NFC changes, offsets are interpolated, monotone, with exact segment ends).
  void encode_append(std::string_view text, std::vector<std::int32_t>& ids,
                     std::vector<std::int64_t>* starts, bool parse_special = true) const;

  // The bytes of the tokens, concatenated; special tokens are left out when skip_special.
  std::string decode(std::span<const std::int32_t> ids, bool skip_special = false) const;

  // Id of an added token ("<|im_end|>") or of a vocabulary entry as spelled in tokenizer.json
  // (byte-level characters, e.g. "Ġthe"); nullopt if there is none.
  std::optional<std::int32_t> token_id(std::string_view token) const;
  // Largest id + 1 (vocabulary and added tokens).
  int vocab_size() const;
  // NFC of valid UTF-8 (invalid sequences replaced by U+FFFD first), as encode() applies it.
  std::string normalize(std::string_view text) const;

  // From tokenizer_config.json when from_dir found one; empty otherwise.
  const std::string& chat_template() const;
  const std::string& eos_token() const;
  // Where the tokenizer was read from (for messages).
  const std::string& source() const;

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

}  // namespace qt
