// prep records: Qwen3 chat rendering against the JavaScript/Jinja reference (fixture), the loss
// mask (decoded trained and untrained spans), and every reason a record is skipped.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "prep/chat.h"
#include "prep/records.h"
#include "tokenizer/qwen3_tokenizer.h"

namespace qt {
namespace {

using json = nlohmann::json;
using prep::Skip;

#define QT_REQUIRE_QWEN3()                           \
  do {                                               \
    if (test::qwen3_tokenizer_dir().empty()) return; \
  } while (0)

std::vector<prep::ChatMessage> to_messages(const json& m) {
  std::vector<prep::ChatMessage> out;
  for (const json& x : m) {
    prep::ChatMessage cm{x["role"], x["content"], std::nullopt};
    if (x.contains("reasoning_content"))
      cm.reasoning_content = x["reasoning_content"].get<std::string>();
    out.push_back(cm);
  }
  return out;
}

TEST(PrepChat, RenderingMatchesQwen3TemplateFixture) {
  QT_REQUIRE_QWEN3();
  const Tokenizer& tok = test::qwen3_tokenizer();
  EXPECT_TRUE(prep::is_qwen3_chat_template(tok.chat_template()));
  EXPECT_FALSE(prep::is_qwen3_chat_template(tok.chat_template() + " "));
  std::ifstream in(QT_TOKENIZER_FIXTURE);
  const json fx = json::parse(in);
  ASSERT_GE(fx["chats"].size(), 10u);
  for (const json& c : fx["chats"]) {
    const prep::RenderedChat r = prep::render_qwen3_chat(to_messages(c["messages"]));
    EXPECT_EQ(r.text, c["text"].get<std::string>()) << "chat " << c["name"];
    EXPECT_EQ(tok.encode(r.text), c["ids"].get<std::vector<std::int32_t>>())
        << "chat " << c["name"];
    // The chat record of prep gives the same ids.
    prep::RecordEncoder enc(tok, prep::Format::kAuto, 0, false, "<|endoftext|>");
    std::vector<std::int32_t> tokens;
    std::vector<std::uint8_t> mask;
    const prep::RecordResult res = enc.add(json{{"messages", c["messages"]}}.dump(), tokens, mask);
    // Every fixture chat has an assistant turn ("ends_with_user" an earlier one): all are used.
    ASSERT_EQ(res.skip, Skip::kNone) << c["name"] << ": " << res.detail;
    EXPECT_EQ(tokens, c["ids"].get<std::vector<std::int32_t>>()) << "chat " << c["name"];
  }
  EXPECT_THROW(prep::render_qwen3_chat({{"narrator", "x", std::nullopt}}), std::invalid_argument);
}

// Decodes the maximal runs of tokens with mask == want.
std::vector<std::string> runs(const Tokenizer& tok, const std::vector<std::int32_t>& ids,
                              const std::vector<std::uint8_t>& mask, std::uint8_t want) {
  std::vector<std::string> out;
  std::vector<std::int32_t> cur;
  for (std::size_t i = 0; i <= ids.size(); ++i) {
    if (i < ids.size() && mask[i] == want) {
      cur.push_back(ids[i]);
    } else if (!cur.empty()) {
      out.push_back(tok.decode(cur));
      cur.clear();
    }
  }
  return out;
}

TEST(PrepRecords, LossMaskCoversAssistantTurnsOnly) {
  QT_REQUIRE_QWEN3();
  const Tokenizer& tok = test::qwen3_tokenizer();
  prep::RecordEncoder enc(tok, prep::Format::kAuto, 0, false, "<|endoftext|>");
  std::vector<std::int32_t> ids;
  std::vector<std::uint8_t> mask;

  // Chat: a system prompt, a finished turn with reasoning in its content, a tool result.
  const json chat = {{"messages",
                      {{{"role", "system"}, {"content", "Be terse."}},
                       {{"role", "user"}, {"content", "Hi there"}},
                       {{"role", "assistant"}, {"content", "<think>\nplan\n</think>\n\nHello!"}},
                       {{"role", "user"}, {"content", "\n\nAdd 2 and 3."}},
                       {{"role", "assistant"}, {"content", "\nCalling."}},
                       {{"role", "tool"}, {"content", "5"}},
                       {{"role", "assistant"}, {"content", "It is 5."}}}}};
  ASSERT_EQ(enc.add(chat.dump(), ids, mask).skip, Skip::kNone);
  ASSERT_EQ(ids.size(), mask.size());
  // "\nCalling." starts with a newline: the token "\n\n" straddles the header and the content,
  // and a token with any byte in the assistant's part is trained.
  EXPECT_EQ(runs(tok, ids, mask, 1),
            (std::vector<std::string>{"Hello!<|im_end|>", "\n\nCalling.<|im_end|>",
                                      "<think>\n\n</think>\n\nIt is 5.<|im_end|>"}));
  EXPECT_EQ(runs(tok, ids, mask, 0),
            (std::vector<std::string>{
                "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                "<|im_start|>assistant\n",
                "\n<|im_start|>user\n\n\nAdd 2 and 3.<|im_end|>\n<|im_start|>assistant",
                "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
                "<|im_start|>assistant\n",
                "\n"}));

  // Instruction: user turn instruction + "\n\n" + input, loss on the output.
  ids.clear();
  mask.clear();
  const json inst = {{"instruction", "Translate."}, {"input", "chat"}, {"output", "cat"}};
  ASSERT_EQ(enc.add(inst.dump(), ids, mask).skip, Skip::kNone);
  EXPECT_EQ(runs(tok, ids, mask, 1),
            (std::vector<std::string>{"<think>\n\n</think>\n\ncat<|im_end|>"}));
  EXPECT_EQ(runs(tok, ids, mask, 0),
            (std::vector<std::string>{
                "<|im_start|>user\nTranslate.\n\nchat<|im_end|>\n<|im_start|>assistant\n", "\n"}));
  ids.clear();
  mask.clear();
  ASSERT_EQ(enc.add(R"({"instruction": "Say yes.", "input": "", "output": "yes", "system": "S"})",
                    ids, mask)
                .skip,
            Skip::kNone);
  EXPECT_EQ(tok.decode(ids),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nSay "
            "yes.<|im_end|>\n<|im_start|>assistant\n"
            "<think>\n\n</think>\n\nyes<|im_end|>\n");

  // Text: every token counted, <|endoftext|> appended.
  ids.clear();
  mask.clear();
  ASSERT_EQ(enc.add(R"({"text": "Plain text."})", ids, mask).skip, Skip::kNone);
  EXPECT_EQ(tok.decode(ids), "Plain text.<|endoftext|>");
  EXPECT_EQ(mask, std::vector<std::uint8_t>(ids.size(), 1));
}

TEST(PrepRecords, SkipReasons) {
  QT_REQUIRE_QWEN3();
  const Tokenizer& tok = test::qwen3_tokenizer();
  prep::RecordEncoder enc(tok, prep::Format::kAuto, 12, false, "<|endoftext|>");
  struct Case {
    const char* line;
    Skip want;
    const char* detail;
  };
  const std::vector<Case> cases = {
      {R"({"text": "ok"})", Skip::kNone, ""},
      {R"({"text": "unterminated)", Skip::kMalformed, "parse error"},
      {R"([1, 2])", Skip::kMalformed, "not a JSON object"},
      {"\xff\xfe", Skip::kMalformed, "parse error"},
      {R"({"prompt": "x"})", Skip::kUnknownFormat,
       "no \"text\", \"messages\" or \"instruction\" key"},
      {R"({"text": 5})", Skip::kInvalid, "\"text\" is not a string"},
      {R"({"messages": {"role": "user"}})", Skip::kInvalid, "\"messages\" is not an array"},
      {R"({"messages": [{"role": "user", "content": null}]})", Skip::kInvalid,
       "messages[0]: no \"content\" string"},
      {R"({"messages": [{"role": "bot", "content": "x"}]})", Skip::kEmpty, "no assistant turn"},
      {R"({"messages": [{"role": "bot", "content": "x"}, {"role": "assistant", "content": "y"}]})",
       Skip::kInvalid, "unknown role 'bot'"},
      {R"({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]}]})",
       Skip::kInvalid, "tool_calls are not supported"},
      {R"({"instruction": "x", "output": 3})", Skip::kInvalid, "\"output\" is not a string"},
      {R"({"instruction": "x", "output": ""})", Skip::kEmpty, "empty instruction or output"},
      {R"({"text": ""})", Skip::kEmpty, "empty text"},
      {"   \r", Skip::kEmpty, "blank line"},
      {R"({"messages": []})", Skip::kEmpty, "no assistant turn"},
      {R"({"text": "one two three four five six seven eight nine ten eleven twelve"})",
       Skip::kTooLong, "13 tokens"},
  };
  for (const Case& c : cases) {
    std::vector<std::int32_t> ids;
    std::vector<std::uint8_t> mask;
    const prep::RecordResult r = enc.add(c.line, ids, mask);
    EXPECT_EQ(r.skip, c.want) << c.line << " -> " << prep::skip_name(r.skip) << ": " << r.detail;
    EXPECT_NE(r.detail.find(c.detail), std::string::npos) << c.line << " -> " << r.detail;
    if (r.skip != Skip::kNone) EXPECT_TRUE(ids.empty() && mask.empty()) << c.line;
  }

  // --format fixes the form; --truncate cuts (and a chat cut inside the prompt has no loss left).
  prep::RecordEncoder chat_only(tok, prep::Format::kChat, 0, false, "<|endoftext|>");
  std::vector<std::int32_t> ids;
  std::vector<std::uint8_t> mask;
  EXPECT_EQ(chat_only.add(R"({"text": "x"})", ids, mask).skip, Skip::kUnknownFormat);
  prep::RecordEncoder cut(tok, prep::Format::kAuto, 5, true, "<|endoftext|>");
  const prep::RecordResult r =
      cut.add(R"({"text": "one two three four five six seven"})", ids, mask);
  EXPECT_EQ(r.skip, Skip::kNone);
  EXPECT_TRUE(r.truncated);
  EXPECT_EQ(tok.decode(ids), "one two three four five");
  ids.clear();
  mask.clear();
  const prep::RecordResult c = cut.add(
      R"({"messages": [{"role": "user", "content": "a long question here"}, {"role": "assistant", "content": "x"}]})",
      ids, mask);
  EXPECT_EQ(c.skip, Skip::kEmpty);
  EXPECT_TRUE(ids.empty());
}

// Invalid UTF-8 in a JSONL line is replaced by U+FFFD, as the tokenizer and plain-text files do,
// and the record is used (issue 15, case 18: it was skipped as malformed JSON).
TEST(PrepRecords, InvalidUtf8IsReplacedByFffd) {
  QT_REQUIRE_QWEN3();
  const Tokenizer& tok = test::qwen3_tokenizer();
  prep::RecordEncoder enc(tok, prep::Format::kAuto, 0, false, "<|endoftext|>");
  const std::int32_t eos = *tok.token_id("<|endoftext|>");
  const std::string fffd = "\xEF\xBF\xBD";
  std::vector<std::int32_t> ids;
  std::vector<std::uint8_t> mask;
  prep::RecordResult r = enc.add("{\"text\": \"caf\xe9 au lait\"}", ids, mask);
  EXPECT_EQ(r.skip, Skip::kNone) << prep::skip_name(r.skip) << ": " << r.detail;
  EXPECT_TRUE(r.repaired);
  std::vector<std::int32_t> want = tok.encode("caf" + fffd + " au lait");
  want.push_back(eos);
  EXPECT_EQ(ids, want);

  ids.clear();
  mask.clear();
  r = enc.add("{\"messages\": [{\"role\": \"user\", \"content\": \"a\xc3\"}, "
              "{\"role\": \"assistant\", \"content\": \"b\xff\xfe\"}]}",
              ids, mask);
  EXPECT_EQ(r.skip, Skip::kNone) << prep::skip_name(r.skip) << ": " << r.detail;
  EXPECT_TRUE(r.repaired);
  const std::string text = tok.decode(ids);
  EXPECT_NE(text.find("user\na" + fffd + "<|im_end|>"), std::string::npos) << text;
  EXPECT_NE(text.find("b" + fffd + fffd + "<|im_end|>"), std::string::npos) << text;

  ids.clear();
  mask.clear();
  r = enc.add_text("plain \x80 text", ids, mask);  // a record of a plain-text file
  EXPECT_EQ(r.skip, Skip::kNone);
  EXPECT_TRUE(r.repaired);
  EXPECT_EQ(tok.decode(ids), "plain " + fffd + " text<|endoftext|>");

  EXPECT_FALSE(enc.add(R"({"text": "café"})", ids, mask).repaired);
  EXPECT_FALSE(enc.add_text("café", ids, mask).repaired);
}

}  // namespace
}  // namespace qt
