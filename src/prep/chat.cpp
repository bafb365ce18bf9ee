// Qwen3's chat template, statement by statement (the Jinja source is quoted in docs/prep.md).
#include "prep/chat.h"

#include <cstdint>
#include <stdexcept>
#include <string_view>

namespace qt::prep {

namespace {

bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }
bool ends_with(std::string_view s, std::string_view p) {
  return s.size() >= p.size() && s.substr(s.size() - p.size()) == p;
}

// Python's str.lstrip("\n"), str.rstrip("\n"), str.strip("\n").
std::string_view lstrip_nl(std::string_view s) {
  while (!s.empty() && s.front() == '\n') s.remove_prefix(1);
  return s;
}
std::string_view rstrip_nl(std::string_view s) {
  while (!s.empty() && s.back() == '\n') s.remove_suffix(1);
  return s;
}
std::string_view strip_nl(std::string_view s) { return rstrip_nl(lstrip_nl(s)); }

// Python's s.split(sep)[0] and s.split(sep)[-1].
std::string_view before_first(std::string_view s, std::string_view sep) {
  const auto p = s.find(sep);
  return p == std::string_view::npos ? s : s.substr(0, p);
}
std::string_view after_last(std::string_view s, std::string_view sep) {
  const auto p = s.rfind(sep);
  return p == std::string_view::npos ? s : s.substr(p + sep.size());
}

}  // namespace

RenderedChat render_qwen3_chat(const std::vector<ChatMessage>& m) {
  RenderedChat r;
  std::string& out = r.text;
  const std::size_t n = m.size();
  if (n > 0 && m[0].role == "system") out += "<|im_start|>system\n" + m[0].content + "<|im_end|>\n";

  // The last user turn that is not a tool response: only assistant turns after it get <think>.
  std::size_t last_query = n == 0 ? 0 : n - 1;
  for (std::size_t k = n; k-- > 0;) {
    const ChatMessage& msg = m[k];
    if (msg.role == "user" && !(starts_with(msg.content, "<tool_response>") &&
                                ends_with(msg.content, "</tool_response>"))) {
      last_query = k;
      break;
    }
  }

  for (std::size_t i = 0; i < n; ++i) {
    const ChatMessage& msg = m[i];
    if (msg.role == "user" || (msg.role == "system" && i != 0)) {
      out += "<|im_start|>" + msg.role + "\n" + msg.content + "<|im_end|>\n";
    } else if (msg.role == "assistant") {
      std::string_view content = msg.content, reasoning;
      if (msg.reasoning_content) {
        reasoning = *msg.reasoning_content;
      } else if (msg.content.find("</think>") != std::string::npos) {
        content = lstrip_nl(after_last(msg.content, "</think>"));
        reasoning =
            lstrip_nl(after_last(rstrip_nl(before_first(msg.content, "</think>")), "<think>"));
      }
      out += "<|im_start|>assistant\n";
      const std::size_t begin = out.size();
      if (i > last_query && (i + 1 == n || !reasoning.empty())) {
        out += "<think>\n";
        out += strip_nl(reasoning);
        out += "\n</think>\n\n";
        out += lstrip_nl(content);
      } else {
        out += content;
      }
      out += "<|im_end|>";
      r.loss_spans.emplace_back(begin, out.size());
      out += "\n";
    } else if (msg.role == "tool") {
      if (i == 0 || m[i - 1].role != "tool") out += "<|im_start|>user";
      out += "\n<tool_response>\n" + msg.content + "\n</tool_response>";
      if (i + 1 == n || m[i + 1].role != "tool") out += "<|im_end|>\n";
    } else if (!(msg.role == "system" && i == 0)) {
      throw std::invalid_argument("unknown role '" + msg.role +
                                  "' (expected system, user, assistant or tool)");
    }
  }
  return r;
}

std::string render_qwen3_generation_prompt(const std::vector<ChatMessage>& messages,
                                           bool enable_thinking) {
  std::string out = render_qwen3_chat(messages).text;
  out += "<|im_start|>assistant\n";
  if (!enable_thinking) out += "<think>\n\n</think>\n\n";
  return out;
}

bool is_qwen3_chat_template(const std::string& tmpl) {
  std::uint64_t h = 0xcbf29ce484222325ULL;  // FNV-1a of the template in Qwen3's tokenizer_config
  for (unsigned char c : tmpl) h = (h ^ c) * 0x100000001b3ULL;
  return h == 0x2bfdb7aa9754484eULL && tmpl.size() == 4116;
}

}  // namespace qt::prep
