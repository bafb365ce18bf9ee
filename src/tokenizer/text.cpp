// UTF-8 repair, NFC (utf8proc), the byte-level alphabet and the PCRE2 pre-tokenizer regex.
#include "tokenizer/text.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>

namespace qt::tok {

namespace {

// Length of the well-formed sequence starting at s[i], or the length of its maximal ill-formed
// subpart as a negative number (-1 for a byte that cannot start a sequence).
int utf8_step(std::string_view s, std::size_t i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) return 1;
  int need = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 2;
    if (b0 == 0xE0) lo = 0xA0;  // no overlongs
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 3;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return -1;
  }
  for (int k = 1; k <= need; ++k) {
    if (i + k >= s.size()) return -k;
    const auto b = static_cast<unsigned char>(s[i + k]);
    const unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) return -k;
  }
  return need + 1;
}

// Oniguruma's \s for Unicode text: U+0009..U+000D, U+0085 and the Zs, Zl, Zp categories.
constexpr const char* kOnigSpace =
    "\\x{09}-\\x{0D}\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
    "\\x{202F}\\x{205F}\\x{3000}";

pcre2_code* as_code(void* p) { return static_cast<pcre2_code*>(p); }

}  // namespace

bool utf8_valid(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const int n = utf8_step(s, i);
    if (n < 0) return false;
    i += static_cast<std::size_t>(n);
  }
  return true;
}

std::string utf8_repair(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 8);
  for (std::size_t i = 0; i < s.size();) {
    const int n = utf8_step(s, i);
    if (n > 0) {
      out.append(s.substr(i, static_cast<std::size_t>(n)));
      i += static_cast<std::size_t>(n);
    } else {
      out.append("\xEF\xBF\xBD");  // U+FFFD
      i += static_cast<std::size_t>(-n);
    }
  }
  return out;
}

std::string nfc(std::string_view s) {
  bool ascii = true;
  for (char c : s) ascii &= static_cast<unsigned char>(c) < 0x80;
  if (ascii) return std::string(s);
  utf8proc_uint8_t* dst = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(
      reinterpret_cast<const utf8proc_uint8_t*>(s.data()), static_cast<utf8proc_ssize_t>(s.size()),
      &dst, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (n < 0) throw std::invalid_argument(std::string("NFC: ") + utf8proc_errmsg(n));
  std::string out(reinterpret_cast<const char*>(dst), static_cast<std::size_t>(n));
  std::free(dst);
  return out;
}

char32_t byte_char(std::uint8_t b) {
  // Printable Latin-1 bytes map to themselves; the other 68 to U+0100 + their rank among them.
  const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
  if (printable) return b;
  int rank = 0;
  for (int c = 0; c < b; ++c) {
    const bool p = (c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || c >= 0xAE;
    rank += p ? 0 : 1;
  }
  return static_cast<char32_t>(0x100 + rank);
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool byte_level_decode(std::string_view s, std::string& out) {
  static const auto inverse = [] {
    std::vector<int> inv(0x200, -1);  // every byte_char is below U+0200
    for (int b = 0; b < 256; ++b) inv[byte_char(static_cast<std::uint8_t>(b))] = b;
    return inv;
  }();
  for (std::size_t i = 0; i < s.size();) {
    const int n = utf8_step(s, i);
    if (n < 0) return false;
    char32_t cp = 0;
    const auto b0 = static_cast<unsigned char>(s[i]);
    if (n == 1) {
      cp = b0;
    } else if (n == 2) {
      cp = ((b0 & 0x1Fu) << 6) | (static_cast<unsigned char>(s[i + 1]) & 0x3Fu);
    } else {
      return false;  // three- and four-byte characters are above U+0800
    }
    if (cp >= inverse.size() || inverse[cp] < 0) return false;
    out.push_back(static_cast<char>(inverse[cp]));
    i += static_cast<std::size_t>(n);
  }
  return true;
}

std::string onig_to_pcre2(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 64);
  bool in_class = false;
  for (std::size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[i + 1];
      ++i;
      if (e == 's') {
        out += in_class ? std::string(kOnigSpace) : "[" + std::string(kOnigSpace) + "]";
      } else if (e == 'S') {
        if (in_class) throw std::invalid_argument("\\S inside a character class is not supported");
        out += "[^" + std::string(kOnigSpace) + "]";
      } else {
        out.push_back('\\');
        out.push_back(e);
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out.push_back(c);
      // A ']' right after '[' or '[^' is a literal member, not the end of the class.
      if (i + 1 < p.size() && p[i + 1] == '^') out.push_back(p[++i]);
      if (i + 1 < p.size() && p[i + 1] == ']') out.push_back(p[++i]);
      continue;
    }
    if (in_class && c == ']') in_class = false;
    out.push_back(c);
  }
  return out;
}

Regex::Regex(const std::string& pattern) {
  int err = 0;
  PCRE2_SIZE off = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP, &err, &off, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    throw std::invalid_argument("regex error at offset " + std::to_string(off) + ": " +
                                reinterpret_cast<const char*>(msg));
  }
  code_ = code;
  jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() { pcre2_code_free(as_code(code_)); }

void Regex::split(std::string_view s,
                  std::vector<std::pair<std::size_t, std::size_t>>& pieces) const {
  struct MatchData {
    pcre2_match_data* md;
    ~MatchData() { pcre2_match_data_free(md); }
  } m{pcre2_match_data_create_from_pattern(as_code(code_), nullptr)};
  if (m.md == nullptr) throw std::bad_alloc();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  std::size_t pos = 0;      // where the next search starts
  std::size_t emitted = 0;  // end of the last piece
  while (pos < s.size()) {
    int rc = pcre2_match(as_code(code_), subject, s.size(), pos, PCRE2_NO_UTF_CHECK, m.md, nullptr);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT)  // the interpreter keeps its backtracking on the heap
      rc = pcre2_match(as_code(code_), subject, s.size(), pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT,
                       m.md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      throw std::runtime_error(std::string("regex match failed: ") +
                               reinterpret_cast<const char*>(msg));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(m.md);
    const std::size_t b = ov[0], e = ov[1];
    if (e == b) {  // an empty match makes no piece: search again one character later
      if (b >= s.size()) break;
      pos = b + static_cast<std::size_t>(std::max(1, utf8_step(s, b)));
      continue;
    }
    if (b > emitted) pieces.emplace_back(emitted, b);
    pieces.emplace_back(b, e);
    emitted = pos = e;
  }
  if (emitted < s.size()) pieces.emplace_back(emitted, s.size());
}

}  // namespace qt::tok
