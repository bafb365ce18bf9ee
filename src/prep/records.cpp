// JSONL records -> documents (records.h, docs/prep.md).
#include "prep/records.h"

#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <utility>

#include "prep/chat.h"
#include "qtrain/error.h"
#include "tokenizer/text.h"

namespace qt::prep {

namespace {

using json = nlohmann::json;

RecordResult skip(Skip s, std::string detail = {}) { return {s, std::move(detail), false}; }

// A short form of nlohmann's message ("[json.exception.parse_error.101] parse error at ...").
std::string short_json_error(const std::string& what) {
  std::string s = what;
  if (auto p = s.find("] "); p != std::string::npos && s.rfind("[json.exception", 0) == 0)
    s = s.substr(p + 2);
  if (s.size() > 160) s = s.substr(0, 157) + "...";
  return s;
}

// The string at j[key]: nullptr when absent or null; throws std::invalid_argument otherwise
// when it is not a string.
const std::string* opt_string(const json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return nullptr;
  if (!it->is_string())
    throw std::invalid_argument(fmt::format("{}\"{}\" is not a string", where, key));
  return &it->get_ref<const std::string&>();
}

}  // namespace

const char* skip_name(Skip s) {
  switch (s) {
    case Skip::kNone:
      return "used";
    case Skip::kMalformed:
      return "malformed JSON";
    case Skip::kInvalid:
      return "invalid record";
    case Skip::kUnknownFormat:
      return "unknown format";
    case Skip::kEmpty:
      return "empty";
    case Skip::kTooLong:
      return "too long";
    case Skip::kCount:
      break;
  }
  return "?";
}

RecordEncoder::RecordEncoder(Tokenizer tok, Format format, std::int64_t max_tokens, bool truncate,
                             const std::string& eos_token)
    : tok_(std::move(tok)), format_(format), max_tokens_(max_tokens), truncate_(truncate) {
  auto id = tok_.token_id(eos_token);
  if (!id) fail_user("--eos {}: the tokenizer {} has no such token", eos_token, tok_.source());
  eos_id_ = *id;
}

RecordResult RecordEncoder::add(std::string_view line, std::vector<std::int32_t>& tokens,
                                std::vector<std::uint8_t>& mask) {
  if (line.find_first_not_of(" \t\r\n") == std::string_view::npos)
    return skip(Skip::kEmpty, "blank line");
  if (!tok::utf8_valid(line)) {  // JSON must be UTF-8; repair it rather than lose the record
    const std::string repaired = tok::utf8_repair(line);
    RecordResult r = add(repaired, tokens, mask);
    r.repaired = true;
    return r;
  }
  json j;
  try {
    j = json::parse(line);
  } catch (const json::exception& e) {
    return skip(Skip::kMalformed, short_json_error(e.what()));
  }
  if (!j.is_object()) return skip(Skip::kMalformed, "not a JSON object");

  Format f = format_;
  if (f == Format::kAuto) {
    if (j.contains("messages"))
      f = Format::kChat;
    else if (j.contains("instruction"))
      f = Format::kInstruction;
    else if (j.contains("text"))
      f = Format::kText;
    else
      return skip(Skip::kUnknownFormat, "no \"text\", \"messages\" or \"instruction\" key");
  } else {
    const char* key = f == Format::kChat ? "messages" : f == Format::kText ? "text" : "instruction";
    if (!j.contains(key)) return skip(Skip::kUnknownFormat, fmt::format("no \"{}\" key", key));
  }

  ids_.clear();
  starts_.clear();
  const std::size_t first = tokens.size();
  try {
    if (f == Format::kText) {
      const std::string* text = opt_string(j, "text", "");
      if (text == nullptr) throw std::invalid_argument("\"text\" is null");
      return add_text(*text, tokens, mask);
    }

    std::vector<ChatMessage> msgs;
    if (f == Format::kChat) {
      const json& m = j["messages"];
      if (!m.is_array()) throw std::invalid_argument("\"messages\" is not an array");
      for (std::size_t i = 0; i < m.size(); ++i) {
        const std::string where = fmt::format("messages[{}]: ", i);
        if (!m[i].is_object()) throw std::invalid_argument(where + "not an object");
        const std::string* role = opt_string(m[i], "role", where);
        const std::string* content = opt_string(m[i], "content", where);
        if (role == nullptr) throw std::invalid_argument(where + "no \"role\"");
        if (content == nullptr) throw std::invalid_argument(where + "no \"content\" string");
        if (m[i].contains("tool_calls") && !m[i]["tool_calls"].is_null() &&
            !m[i]["tool_calls"].empty())
          throw std::invalid_argument(where + "tool_calls are not supported");
        ChatMessage cm{*role, tok_.normalize(*content), std::nullopt};
        if (const std::string* rc = opt_string(m[i], "reasoning_content", where))
          cm.reasoning_content = tok_.normalize(*rc);
        msgs.push_back(std::move(cm));
      }
    } else {
      const std::string* instruction = opt_string(j, "instruction", "");
      const std::string* input = opt_string(j, "input", "");
      const std::string* output = opt_string(j, "output", "");
      const std::string* system = opt_string(j, "system", "");
      if (instruction == nullptr || output == nullptr)
        throw std::invalid_argument("needs \"instruction\" and \"output\" strings");
      if (instruction->empty() || output->empty())
        return skip(Skip::kEmpty, "empty instruction or output");
      if (system != nullptr) msgs.push_back({"system", tok_.normalize(*system), std::nullopt});
      std::string user = *instruction;
      if (input != nullptr && !input->empty()) user += "\n\n" + *input;
      msgs.push_back({"user", tok_.normalize(user), std::nullopt});
      msgs.push_back({"assistant", tok_.normalize(*output), std::nullopt});
    }
    bool has_assistant = false;
    for (const ChatMessage& cm : msgs) has_assistant |= cm.role == "assistant";
    if (!has_assistant) return skip(Skip::kEmpty, "no assistant turn");

    const RenderedChat r = render_qwen3_chat(msgs);
    tok_.encode_append(r.text, ids_, &starts_);
    bool truncated = false;
    if (max_tokens_ > 0 && static_cast<std::int64_t>(ids_.size()) > max_tokens_) {
      if (!truncate_) return skip(Skip::kTooLong, fmt::format("{} tokens", ids_.size()));
      truncated = true;
    }
    const std::size_t n = truncated ? static_cast<std::size_t>(max_tokens_) : ids_.size();
    // A token is trained when any of its bytes lies in a loss span.
    std::size_t s = 0, trained = 0;
    tokens.insert(tokens.end(), ids_.begin(), ids_.begin() + static_cast<std::ptrdiff_t>(n));
    for (std::size_t k = 0; k < n; ++k) {
      const auto begin = static_cast<std::size_t>(starts_[k]);
      const std::size_t end =
          k + 1 < starts_.size() ? static_cast<std::size_t>(starts_[k + 1]) : r.text.size();
      while (s < r.loss_spans.size() && r.loss_spans[s].second <= begin) ++s;
      const bool in = s < r.loss_spans.size() && r.loss_spans[s].first < std::max(end, begin + 1);
      mask.push_back(in ? 1 : 0);
      trained += in ? 1 : 0;
    }
    if (trained == 0) {  // only possible after truncation
      tokens.resize(first);
      mask.resize(first);
      return skip(Skip::kEmpty, "no assistant token left after truncation");
    }
    return {Skip::kNone, {}, truncated};
  } catch (const std::invalid_argument& e) {
    tokens.resize(first);
    mask.resize(first);
    return skip(Skip::kInvalid, e.what());
  } catch (const json::exception& e) {
    tokens.resize(first);
    mask.resize(first);
    return skip(Skip::kInvalid, short_json_error(e.what()));
  } catch (const UserError&) {
    throw;
  } catch (const std::runtime_error& e) {  // the tokenizer's (a regex that hit its match limit)
    tokens.resize(first);
    mask.resize(first);
    return skip(Skip::kInvalid, std::string("cannot tokenize: ") + e.what());
  }
}

RecordResult RecordEncoder::add_text(std::string_view text, std::vector<std::int32_t>& tokens,
                                     std::vector<std::uint8_t>& mask) {
  if (text.empty()) return skip(Skip::kEmpty, "empty text");
  const bool repaired = !tok::utf8_valid(text);  // encode_append replaces it by U+FFFD
  ids_.clear();
  try {
    tok_.encode_append(text, ids_, nullptr);
  } catch (const UserError&) {
    throw;
  } catch (const std::runtime_error& e) {  // the tokenizer's (a regex that hit its match limit)
    return skip(Skip::kInvalid, std::string("cannot tokenize: ") + e.what());
  }
  ids_.push_back(eos_id_);
  bool truncated = false;
  if (max_tokens_ > 0 && static_cast<std::int64_t>(ids_.size()) > max_tokens_) {
    if (!truncate_) return skip(Skip::kTooLong, fmt::format("{} tokens", ids_.size()));
    ids_.resize(static_cast<std::size_t>(max_tokens_));
    truncated = true;
  }
  tokens.insert(tokens.end(), ids_.begin(), ids_.end());
  mask.insert(mask.end(), ids_.size(), 1);
  return {Skip::kNone, {}, truncated, repaired};
}

}  // namespace qt::prep
