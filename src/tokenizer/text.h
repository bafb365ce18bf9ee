// Text helpers of the tokenizer: UTF-8 repair, NFC, the byte-level alphabet and the pre-tokenizer
// regex (PCRE2). Internal; exposed for tests.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace qt::tok {

// True when `s` is well-formed UTF-8 (no overlongs, surrogates or code points above U+10FFFF).
bool utf8_valid(std::string_view s);
// `s` with every maximal ill-formed subpart replaced by U+FFFD (Unicode's "substitution of
// maximal subparts", as Python's decode(errors="replace") and the WHATWG decoder do).
std::string utf8_repair(std::string_view s);

// NFC of valid UTF-8. ASCII text is returned unchanged without a call into utf8proc.
std::string nfc(std::string_view s);

// GPT-2's byte-level alphabet: byte b is written as the code point byte_char(b) (printable
// bytes as themselves, the others shifted to U+0100 and up).
char32_t byte_char(std::uint8_t b);
// UTF-8 of one code point.
void append_utf8(std::string& out, char32_t cp);
// Inverse of the byte-level mapping for a whole token string: its bytes, or false when `s` holds
// a character outside the alphabet.
bool byte_level_decode(std::string_view s, std::string& out);

// A pattern in Oniguruma syntax (tokenizers' regex engine) with \s and \S rewritten to
// Oniguruma's Unicode whitespace set, so that PCRE2 of any version matches the same characters.
// Throws std::invalid_argument for \S inside a character class.
std::string onig_to_pcre2(std::string_view pattern);

// A compiled pattern (UTF, UCP; JIT when available). Thread safe.
class Regex {
 public:
  // Throws std::invalid_argument with PCRE2's message and offset when the pattern is bad.
  explicit Regex(const std::string& pcre2_pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Splits valid UTF-8 `s` like tokenizers' Split(behavior = Isolated): every match and every
  // gap between matches is one piece. Appends [begin, end) byte ranges to `pieces`.
  void split(std::string_view s, std::vector<std::pair<std::size_t, std::size_t>>& pieces) const;
  bool jit() const { return jit_; }

 private:
  void* code_ = nullptr;  // pcre2_code_8*
  bool jit_ = false;
};

}  // namespace qt::tok
