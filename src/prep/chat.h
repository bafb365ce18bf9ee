// Qwen3's chat template (ChatML with <think> handling) rendered in C++, with the byte spans of
// the assistant's part of every assistant turn (the loss spans). Matches the Jinja template of
// Qwen3's tokenizer_config.json with add_generation_prompt = false and no tools (docs/prep.md).
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace qt::prep {

struct ChatMessage {
  std::string role;  // system | user | assistant | tool
  std::string content;
  std::optional<std::string> reasoning_content;  // assistant only; JSON null = absent
};

struct RenderedChat {
  std::string text;
  // [begin, end) byte ranges of `text` that are trained: for each assistant turn, everything
  // after "<|im_start|>assistant\n" up to and including its "<|im_end|>".
  std::vector<std::pair<std::size_t, std::size_t>> loss_spans;
};

// Renders `messages`; throws std::invalid_argument for an unknown role.
RenderedChat render_qwen3_chat(const std::vector<ChatMessage>& messages);

// The prompt for generating the next assistant turn (`qtrain generate --chat`): `messages`
// rendered as above, then "<|im_start|>assistant\n" as the template adds with
// add_generation_prompt=True, and "<think>\n\n</think>\n\n" after it when enable_thinking is
// false (the template's enable_thinking=False: the model answers without reasoning).
std::string render_qwen3_generation_prompt(const std::vector<ChatMessage>& messages,
                                           bool enable_thinking = true);

// The chat template text this renderer reproduces: true when `tmpl` is Qwen3's (prep warns when
// a tokenizer directory brings another one).
bool is_qwen3_chat_template(const std::string& tmpl);

}  // namespace qt::prep
