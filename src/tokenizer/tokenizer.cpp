// Tokenizer: reading tokenizer.json / tokenizer_config.json, added-token splitting, encode and
// decode (include/qtrain/tokenizer.h, docs/tokenizer.md).
#include "qtrain/tokenizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <unordered_map>

#include "io/json_file.h"
#include "qtrain/error.h"
#include "tokenizer/bpe.h"
#include "tokenizer/text.h"

namespace qt {

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// GPT-2's pre-tokenizer pattern (ByteLevel with use_regex = true).
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

struct AddedToken {
  std::string content;
  std::int32_t id = 0;
  bool special = false, lstrip = false, rstrip = false;
};

// Unicode White_Space (Rust's char::is_whitespace, which tokenizers uses for lstrip/rstrip).
bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

// Decodes the code point at s[i] of valid UTF-8; sets `len`.
char32_t decode_at(std::string_view s, std::size_t i, int& len) {
  const auto b = static_cast<unsigned char>(s[i]);
  auto cont = [&](std::size_t k) { return static_cast<unsigned char>(s[i + k]) & 0x3Fu; };
  if (b < 0x80) return len = 1, b;
  if (b < 0xE0) return len = 2, ((b & 0x1Fu) << 6) | cont(1);
  if (b < 0xF0) return len = 3, ((b & 0x0Fu) << 12) | (cont(1) << 6) | cont(2);
  return len = 4, ((b & 0x07u) << 18) | (cont(1) << 12) | (cont(2) << 6) | cont(3);
}

// Start of the code point that ends at s[end) (valid UTF-8, end > 0).
std::size_t prev_char(std::string_view s, std::size_t end) {
  std::size_t i = end - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  return i;
}

// Token ids are below this (4 Mi; real vocabularies have up to a few hundred thousand): the id
// tables are sized by the largest id, so a file must not be able to ask for gigabytes.
constexpr std::int64_t kMaxTokenId = std::int64_t{1} << 22;

// The id that `v` holds when it is an integer in [0, kMaxTokenId); nullopt otherwise (also for
// 3e9 or 2^64 - 1, which a 32-bit or signed read would wrap).
std::optional<std::int32_t> token_id_of(const json& v) {
  if (v.is_number_unsigned()) {
    const auto u = v.get<std::uint64_t>();
    if (u < static_cast<std::uint64_t>(kMaxTokenId)) return static_cast<std::int32_t>(u);
  } else if (v.is_number_integer()) {
    const auto i = v.get<std::int64_t>();
    if (i >= 0 && i < kMaxTokenId) return static_cast<std::int32_t>(i);
  }
  return std::nullopt;
}

// chat_template and eos_token of a tokenizer_config.json (null or absent: left empty).
void read_config(const json& c, const std::string& path, std::string& chat_template,
                 std::string& eos_token) {
  auto bad = [&](const char* key, const char* what) -> void {
    fail_user("tokenizer config {}: {}{}{}", path, key, *key ? ": " : "", what);
  };
  if (!c.is_object()) bad("", "expected a JSON object");
  const json null;
  const json& ct = c.contains("chat_template") ? c["chat_template"] : null;
  if (ct.is_string()) {
    chat_template = ct.get<std::string>();
  } else if (ct.is_array()) {  // [{"name": ..., "template": ...}]: the one named "default"
    for (std::size_t k = 0; k < ct.size(); ++k) {
      const json& e = ct[k];
      if (!e.is_object() || !e.contains("name") || !e["name"].is_string() ||
          !e.contains("template") || !e["template"].is_string())
        bad(fmt::format("chat_template[{}]", k).c_str(),
            "expected {\"name\": string, \"template\": string}");
      if (e["name"] == "default") chat_template = e["template"].get<std::string>();
    }
  } else if (!ct.is_null()) {
    bad("chat_template", "expected a string or a list of {\"name\", \"template\"}");
  }
  const json& e = c.contains("eos_token") ? c["eos_token"] : null;
  if (e.is_string())
    eos_token = e.get<std::string>();
  else if (e.is_object() && e.contains("content") && e["content"].is_string())
    eos_token = e["content"].get<std::string>();
  else if (!e.is_null())
    bad("eos_token", "expected a string or {\"content\": string}");
}

}  // namespace

struct Tokenizer::Impl {
  std::string source;
  std::unordered_map<std::string, std::int32_t> vocab;  // tokenizer.json spelling -> id
  std::vector<std::string> id_bytes;                    // id -> raw bytes ("" where no token)
  std::vector<char> id_known, id_special;
  std::vector<AddedToken> added;                    // longest first
  std::array<std::vector<int>, 256> added_by_byte;  // first byte -> indices into `added`
  bool nfc = false;
  std::unique_ptr<tok::Regex> regex;
  tok::BpeModel bpe;
  std::string chat_template, eos_token;

  void load(const json& j, const std::string& path);
  void encode_segment(std::string_view seg, std::size_t base, std::vector<std::int32_t>& ids,
                      std::vector<std::int64_t>* starts) const;
};

void Tokenizer::Impl::load(const json& j, const std::string& path) {
  auto bad = [&](const std::string& key, const std::string& what) -> void {
    fail_user("tokenizer file {}: {}: {}", path, key, what);
  };
  if (!j.is_object()) bad("(top level)", "expected a JSON object");

  // Model: byte-level BPE only.
  if (!j.contains("model") || !j["model"].is_object()) bad("model", "missing or not an object");
  const json& m = j["model"];
  const std::string type = m.value("type", std::string("BPE"));
  if (type != "BPE") bad("model.type", fmt::format("'{}' is not supported (only BPE)", type));
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (m.contains(key) && !m[key].is_null() && m[key] != "")
      bad(fmt::format("model.{}", key), "must be empty for byte-level BPE");
  if (m.value("byte_fallback", false)) bad("model.byte_fallback", "true is not supported");
  if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"] != 0)
    bad("model.dropout", "BPE dropout is not supported");
  bpe.ignore_merges = m.value("ignore_merges", false);

  if (!m.contains("vocab") || !m["vocab"].is_object())
    bad("model.vocab", "missing or not an object");
  std::vector<std::pair<std::string, std::int32_t>> entries;  // in the file's (sorted) key order
  for (const auto& [tok, idj] : m["vocab"].items()) {
    const auto id = token_id_of(idj);
    if (!id)
      bad("model.vocab", fmt::format("id of '{}' must be an integer in [0, {}), got {}", tok,
                                     kMaxTokenId, idj.dump()));
    entries.emplace_back(tok, *id);
  }
  if (entries.empty()) bad("model.vocab", "is empty");

  // Added tokens (may lie outside the model's vocabulary).
  if (j.contains("added_tokens") && !j["added_tokens"].is_null()) {
    if (!j["added_tokens"].is_array()) bad("added_tokens", "not an array");
    std::size_t k = 0;
    for (const json& a : j["added_tokens"]) {
      const std::string key = fmt::format("added_tokens[{}]", k++);
      if (!a.is_object() || !a.contains("id") || !a.contains("content") ||
          !a["content"].is_string())
        bad(key, "needs an integer id >= 0 and a string content");
      const auto id = token_id_of(a["id"]);
      if (!id)
        bad(key, fmt::format("id must be an integer in [0, {}), got {}", kMaxTokenId,
                             a["id"].dump()));
      if (a.value("single_word", false)) bad(key, "single_word = true is not supported");
      AddedToken t{a["content"].get<std::string>(), *id, a.value("special", false),
                   a.value("lstrip", false), a.value("rstrip", false)};
      if (t.content.empty()) bad(key, "content is empty");
      added.push_back(std::move(t));
    }
  }

  // id -> bytes. Every id names one token; an added token may repeat the vocabulary entry of
  // its id (GPT-2's <|endoftext|> is both).
  std::int32_t max_id = 0;
  for (const auto& e : entries) max_id = std::max(max_id, e.second);
  for (const AddedToken& t : added) max_id = std::max(max_id, t.id);
  id_bytes.assign(static_cast<std::size_t>(max_id) + 1, std::string());
  id_known.assign(id_bytes.size(), 0);
  id_special.assign(id_bytes.size(), 0);
  std::vector<const std::string*> spelling(id_bytes.size(), nullptr);  // model.vocab key of id
  for (const auto& [tok, id] : entries) {
    if (spelling[id] != nullptr)
      bad("model.vocab", fmt::format("'{}' and '{}' have the same id {}", *spelling[id], tok, id));
    spelling[id] = &tok;
    std::string bytes;
    if (!tok::byte_level_decode(tok, bytes))
      bad("model.vocab", fmt::format("'{}' is not spelled in the byte-level alphabet", tok));
    vocab.emplace(tok, id);
    id_bytes[id] = std::move(bytes);
    id_known[id] = 1;
  }
  std::vector<int> added_at(id_bytes.size(), -1);  // index into `added` of id
  for (std::size_t k = 0; k < added.size(); ++k) {
    const AddedToken& t = added[k];
    const std::string key = fmt::format("added_tokens[{}]", k);
    if (added_at[t.id] >= 0)
      bad(key, fmt::format("id {} is also the id of added_tokens[{}] ('{}')", t.id,
                           added_at[t.id], added[added_at[t.id]].content));
    if (spelling[t.id] != nullptr && id_bytes[t.id] != t.content)
      bad(key, fmt::format("id {} ('{}') is already the id of model.vocab entry '{}'", t.id,
                           t.content, *spelling[t.id]));
    added_at[t.id] = static_cast<int>(k);
    id_bytes[t.id] = t.content;
    id_known[t.id] = 1;
    id_special[t.id] = t.special ? 1 : 0;
  }
  std::stable_sort(added.begin(), added.end(), [](const AddedToken& a, const AddedToken& b) {
    return a.content.size() > b.content.size();
  });
  for (std::size_t i = 0; i < added.size(); ++i)
    added_by_byte[static_cast<unsigned char>(added[i].content[0])].push_back(static_cast<int>(i));
  for (int b = 0; b < 256; ++b) {
    std::string s;
    tok::append_utf8(s, tok::byte_char(static_cast<std::uint8_t>(b)));
    auto it = vocab.find(s);
    if (it == vocab.end())
      bad("model.vocab", fmt::format("has no token for byte 0x{:02X} ('{}')", b, s));
    bpe.byte_id[b] = it->second;
  }
  if (bpe.ignore_merges)
    for (std::int32_t id = 0; id < static_cast<std::int32_t>(id_bytes.size()); ++id)
      if (id_known[id]) bpe.whole_words.emplace(id_bytes[id], id);

  // Merges: "a b" strings (older files) or ["a", "b"] pairs.
  if (!m.contains("merges") || !m["merges"].is_array())
    bad("model.merges", "missing or not an array");
  const json& merges = m["merges"];
  bpe.merges = tok::MergeTable(merges.size());
  for (std::size_t r = 0; r < merges.size(); ++r) {
    const json& e = merges[r];
    std::string a, b;
    if (e.is_string()) {
      const std::string s = e.get<std::string>();
      const auto sp = s.find(' ');
      if (sp == std::string::npos || sp == 0 || sp + 1 == s.size() ||
          s.find(' ', sp + 1) != std::string::npos)
        bad(fmt::format("model.merges[{}]", r),
            fmt::format("'{}' is not two tokens separated by one space", s));
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      a = e[0].get<std::string>();
      b = e[1].get<std::string>();
    } else {
      bad(fmt::format("model.merges[{}]", r), "expected \"a b\" or [\"a\", \"b\"]");
    }
    auto ia = vocab.find(a), ib = vocab.find(b), im = vocab.find(a + b);
    if (ia == vocab.end() || ib == vocab.end() || im == vocab.end())
      bad(fmt::format("model.merges[{}]", r),
          fmt::format("'{}' + '{}' uses or makes a token that is not in model.vocab", a, b));
    bpe.merges.insert(ia->second, ib->second,
                      {static_cast<std::int32_t>(r), static_cast<std::int32_t>(im->second)});
  }

  // Normalizer: none or NFC (alone or in a Sequence).
  if (j.contains("normalizer") && !j["normalizer"].is_null()) {
    const json& n = j["normalizer"];
    const std::string nt = n.value("type", std::string());
    if (nt == "NFC") {
      nfc = true;
    } else if (nt == "Sequence" && n.contains("normalizers") && n["normalizers"].is_array()) {
      for (const json& x : n["normalizers"]) {
        if (x.value("type", std::string()) != "NFC")
          bad("normalizer",
              fmt::format("'{}' is not supported (only NFC)", x.value("type", std::string("?"))));
        nfc = true;
      }
    } else {
      bad("normalizer", fmt::format("'{}' is not supported (only NFC)", nt));
    }
  }

  // Pre-tokenizer: ByteLevel(use_regex) alone, or Split(Regex, Isolated) then ByteLevel.
  if (!j.contains("pre_tokenizer") || !j["pre_tokenizer"].is_object())
    bad("pre_tokenizer", "missing or not an object");
  std::vector<json> steps;
  const json& pt = j["pre_tokenizer"];
  if (pt.value("type", std::string()) == "Sequence" && pt.contains("pretokenizers") &&
      pt["pretokenizers"].is_array())
    for (const json& s : pt["pretokenizers"]) steps.push_back(s);
  else
    steps.push_back(pt);
  std::string pattern;
  bool byte_level = false;
  for (const json& s : steps) {
    const std::string st = s.value("type", std::string());
    if (st == "Split" && pattern.empty() && !byte_level) {
      if (!s.contains("pattern") || !s["pattern"].is_object() || !s["pattern"].contains("Regex") ||
          !s["pattern"]["Regex"].is_string())
        bad("pre_tokenizer", "Split needs pattern.Regex (a string pattern is not supported)");
      if (s.value("behavior", std::string()) != "Isolated" || s.value("invert", false))
        bad("pre_tokenizer", "Split must have behavior Isolated and invert false");
      pattern = s["pattern"]["Regex"].get<std::string>();
    } else if (st == "ByteLevel" && !byte_level) {
      byte_level = true;
      if (s.value("add_prefix_space", false))
        bad("pre_tokenizer", "ByteLevel add_prefix_space = true is not supported");
      if (s.value("use_regex", true)) {
        if (!pattern.empty())
          bad("pre_tokenizer",
              "Split followed by ByteLevel with use_regex = true is not supported");
        pattern = kGpt2Pattern;
      }
    } else {
      bad("pre_tokenizer", fmt::format("'{}' is not supported here (byte-level BPE needs "
                                       "[Split(Regex)] then ByteLevel)",
                                       st));
    }
  }
  if (!byte_level) bad("pre_tokenizer", "no ByteLevel step (only byte-level BPE is supported)");
  try {
    regex = std::make_unique<tok::Regex>(tok::onig_to_pcre2(pattern));
  } catch (const std::invalid_argument& e) {
    bad("pre_tokenizer", fmt::format("pattern /{}/: {}", pattern, e.what()));
  }
  if (j.contains("decoder") && !j["decoder"].is_null() &&
      j["decoder"].value("type", std::string()) != "ByteLevel")
    bad("decoder", fmt::format("'{}' is not supported (only ByteLevel)",
                               j["decoder"].value("type", std::string("?"))));
}

void Tokenizer::Impl::encode_segment(std::string_view seg, std::size_t base,
                                     std::vector<std::int32_t>& ids,
                                     std::vector<std::int64_t>* starts) const {
  if (seg.empty()) return;
  std::string norm_buf;
  std::string_view text = seg;
  if (nfc) {
    norm_buf = tok::nfc(seg);
    if (norm_buf != seg) text = norm_buf;
  }
  std::vector<std::pair<std::size_t, std::size_t>> pieces;
  regex->split(text, pieces);
  const bool same = text.data() == seg.data();
  for (const auto& [b, e] : pieces) {
    const std::size_t first = ids.size();
    bpe.encode_word(text.substr(b, e - b), ids);
    if (starts == nullptr) continue;
    std::size_t off = b;
    for (std::size_t k = first; k < ids.size(); ++k) {
      // Offsets in the normalised text are mapped linearly onto the original segment.
      const std::size_t o = same ? off : off * seg.size() / text.size();
      starts->push_back(static_cast<std::int64_t>(base + o));
      off += id_bytes[ids[k]].size();
    }
  }
}

Tokenizer Tokenizer::from_file(const std::string& path) {
  auto impl = std::make_shared<Impl>();
  impl->source = path;
  const json j = io::read_json_file(path, "tokenizer file");
  try {
    impl->load(j, path);
  } catch (const json::exception& e) {  // a value of the wrong JSON type somewhere
    fail_user("tokenizer file {}: unexpected structure ({})", path, e.what());
  }
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::from_dir(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) fail_user("tokenizer {}: no such file or directory", path);
  if (!fs::is_directory(path, ec)) return from_file(path);
  const std::string tj = (fs::path(path) / "tokenizer.json").string();
  if (!fs::exists(tj, ec))
    fail_user(
        "tokenizer directory {}: has no tokenizer.json (scripts/get-tokenizer.sh fetches "
        "Qwen3's)",
        path);
  Tokenizer t = from_file(tj);
  const std::string cj = (fs::path(path) / "tokenizer_config.json").string();
  if (fs::exists(cj, ec)) {
    const json c = io::read_json_file(cj, "tokenizer config");
    read_config(c, cj, t.impl_->chat_template, t.impl_->eos_token);
  }
  const std::string jinja = (fs::path(path) / "chat_template.jinja").string();
  if (t.impl_->chat_template.empty() && fs::exists(jinja, ec))
    t.impl_->chat_template = io::read_text_file(jinja, "chat template");
  return t;
}

std::vector<std::int32_t> Tokenizer::encode(std::string_view text, bool parse_special) const {
  std::vector<std::int32_t> ids;
  encode_append(text, ids, nullptr, parse_special);
  return ids;
}

void Tokenizer::encode_append(std::string_view input, std::vector<std::int32_t>& ids,
                              std::vector<std::int64_t>* starts, bool parse_special) const {
  const Impl& im = *impl_;
  std::string repaired;
  std::string_view text = input;
  if (!tok::utf8_valid(input)) {
    repaired = tok::utf8_repair(input);
    text = repaired;
  }
  ids.reserve(ids.size() + text.size() / 3);
  std::size_t seg_begin = 0;  // start of the text not yet encoded
  for (std::size_t p = 0; p < text.size(); ++p) {
    const auto& cands = im.added_by_byte[static_cast<unsigned char>(text[p])];
    const AddedToken* hit = nullptr;
    for (int c : cands) {  // longest first
      const AddedToken& t = im.added[c];
      if ((parse_special || !t.special) && text.compare(p, t.content.size(), t.content) == 0) {
        hit = &t;
        break;
      }
    }
    if (hit == nullptr) continue;
    std::size_t b = p, e = p + hit->content.size();
    int len = 0;
    if (hit->lstrip)
      while (b > seg_begin && is_white_space(decode_at(text, prev_char(text, b), len)))
        b = prev_char(text, b);
    if (hit->rstrip)
      while (e < text.size() && is_white_space(decode_at(text, e, len)))
        e += static_cast<std::size_t>(len);
    im.encode_segment(text.substr(seg_begin, b - seg_begin), seg_begin, ids, starts);
    ids.push_back(hit->id);
    if (starts != nullptr) starts->push_back(static_cast<std::int64_t>(b));
    seg_begin = e;
    p = e - 1;
  }
  im.encode_segment(text.substr(seg_begin), seg_begin, ids, starts);
}

std::string Tokenizer::decode(std::span<const std::int32_t> ids, bool skip_special) const {
  const Impl& im = *impl_;
  std::string out;
  for (std::int32_t id : ids) {
    if (id < 0 || id >= static_cast<std::int32_t>(im.id_bytes.size()) || !im.id_known[id])
      fail_user("tokenizer {}: cannot decode id {}: no such token (vocabulary size {})", im.source,
                id, im.id_bytes.size());
    if (skip_special && im.id_special[id]) continue;
    out += im.id_bytes[id];
  }
  return out;
}

std::optional<std::int32_t> Tokenizer::token_id(std::string_view token) const {
  for (const AddedToken& t : impl_->added)
    if (t.content == token) return t.id;
  auto it = impl_->vocab.find(std::string(token));
  if (it == impl_->vocab.end()) return std::nullopt;
  return it->second;
}

int Tokenizer::vocab_size() const { return static_cast<int>(impl_->id_bytes.size()); }

std::string Tokenizer::normalize(std::string_view text) const {
  std::string s = tok::utf8_valid(text) ? std::string(text) : tok::utf8_repair(text);
  return impl_->nfc ? tok::nfc(s) : s;
}

const std::string& Tokenizer::chat_template() const { return impl_->chat_template; }
const std::string& Tokenizer::eos_token() const { return impl_->eos_token; }
const std::string& Tokenizer::source() const { return impl_->source; }

}  // namespace qt
