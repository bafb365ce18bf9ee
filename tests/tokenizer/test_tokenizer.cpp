// The Qwen3 tokenizer against the committed reference ids (tests/reference/fixtures/
// tokenizer_qwen3.json, written by tokenizer_ref.mjs; tokenizer_ref.py checks the same file with
// transformers), decode round trips on fresh random text, offsets, and throughput.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "qtrain/error.h"
#include "qtrain/tokenizer.h"
#include "support/random.h"
#include "tokenizer/qwen3_tokenizer.h"
#include "tokenizer/text.h"

namespace qt {
namespace {

using json = nlohmann::json;

#define QT_REQUIRE_QWEN3()                           \
  do {                                               \
    if (test::qwen3_tokenizer_dir().empty()) return; \
  } while (0)

json load_fixture(const char* path = QT_TOKENIZER_FIXTURE) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot open " << path;
  return json::parse(in);
}

std::string from_hex(const std::string& hex) {
  std::string out;
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2)
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

// The input bytes of a fixture text case ("text", or "hex" for invalid UTF-8).
std::string case_bytes(const json& c) {
  return c.contains("hex") ? from_hex(c["hex"].get<std::string>()) : c["text"].get<std::string>();
}

TEST(Qwen3Tokenizer, MatchesReferenceIdsAndDecodes) {
  QT_REQUIRE_QWEN3();
  const Tokenizer& tok = test::qwen3_tokenizer();
  const json fx = load_fixture();
  ASSERT_GE(fx["texts"].size(), 10u);
  for (const json& c : fx["texts"]) {
    const std::string name = c["name"], bytes = case_bytes(c);
    const auto ids = tok.encode(bytes);
    EXPECT_EQ(ids, c["ids"].get<std::vector<std::int32_t>>()) << "case " << name;
    // decode gives what transformers' decode gives: the NFC text, U+FFFD for invalid bytes.
    EXPECT_EQ(tok.decode(ids), c["decoded"].get<std::string>()) << "case " << name;
    if (tok::utf8_valid(bytes) && tok.normalize(bytes) == bytes)
      EXPECT_EQ(tok.decode(ids), bytes) << "case " << name << ": decode must restore the bytes";
  }
  for (const json& c : fx["chats"])
    EXPECT_EQ(tok.encode(c["text"].get<std::string>()), c["ids"].get<std::vector<std::int32_t>>())
        << "chat " << c["name"];
}

// Random texts over troublesome code points (U+0085, U+FEFF, combining marks, jamo, 'S and 'ſ,
// unassigned code points...), ids and decoded text from transformers (tokenizer_ref.py on
// tokenizer_stress_cases.json).
TEST(Qwen3Tokenizer, MatchesTransformersOnStressTexts) {
  QT_REQUIRE_QWEN3();
  const Tokenizer& tok = test::qwen3_tokenizer();
  const json fx = load_fixture(QT_TOKENIZER_STRESS_FIXTURE);
  ASSERT_GE(fx["texts"].size(), 100u);
  int bad = 0;
  for (const json& c : fx["texts"]) {
    const std::string text = c["text"];
    const auto ids = tok.encode(text);
    const bool ok = ids == c["ids"].get<std::vector<std::int32_t>>();
    EXPECT_TRUE(ok) << "case " << c["name"] << " text " << json(text).dump();
    EXPECT_EQ(tok.decode(ids), c["decoded"].get<std::string>()) << "case " << c["name"];
    bad += ok ? 0 : 1;
  }
  EXPECT_EQ(bad, 0);
}

TEST(Qwen3Tokenizer, SpecialTokensAndVocabulary) {
  QT_REQUIRE_QWEN3();
  const Tokenizer& tok = test::qwen3_tokenizer();
  EXPECT_EQ(tok.vocab_size(), 151669);
  EXPECT_EQ(tok.token_id("<|endoftext|>"), 151643);
  EXPECT_EQ(tok.token_id("<|im_start|>"), 151644);
  EXPECT_EQ(tok.token_id("<|im_end|>"), 151645);
  EXPECT_EQ(tok.token_id("<think>"), 151667);
  EXPECT_EQ(tok.token_id("Ġthe"), tok.encode(" the").at(0));
  EXPECT_FALSE(tok.token_id("no such token").has_value());
  EXPECT_EQ(tok.eos_token(), "<|im_end|>");
  EXPECT_NE(tok.chat_template().find("<|im_start|>"), std::string::npos);

  // parse_special = false: special tokens are plain text, non-special added ones still split.
  const std::string text = "a<|im_end|>b<think>c";
  const auto plain = tok.encode(text, false);
  for (std::int32_t id : plain) EXPECT_NE(id, 151645);
  EXPECT_NE(std::find(plain.begin(), plain.end(), 151667), plain.end());
  EXPECT_EQ(tok.decode(plain), text);
  const auto parsed = tok.encode(text, true);
  EXPECT_NE(std::find(parsed.begin(), parsed.end(), 151645), parsed.end());
  EXPECT_EQ(tok.decode(parsed), text);
  EXPECT_EQ(tok.decode(parsed, /*skip_special=*/true), "ab<think>c");
  EXPECT_THROW(tok.decode(std::vector<std::int32_t>{151669}), UserError);
  EXPECT_THROW(tok.decode(std::vector<std::int32_t>{-1}), UserError);
}

// Random text from a pool of ASCII, Latin, CJK, emoji, whitespace and special tokens: decode
// (encode(x)) is NFC(x), and every token's start offset points at the bytes it decodes to.
TEST(Qwen3Tokenizer, RandomRoundTripAndOffsets) {
  QT_REQUIRE_QWEN3();
  const Tokenizer& tok = test::qwen3_tokenizer();
  std::mt19937_64 rng(test::test_seed());
  const std::vector<std::string> pool = {"a",
                                         "b",
                                         "Z",
                                         "the",
                                         " ",
                                         "  ",
                                         "\t",
                                         "\n",
                                         "\r\n",
                                         "0",
                                         "7",
                                         ".",
                                         ",",
                                         "'s",
                                         "'LL",
                                         "é",
                                         "ß",
                                         "я",
                                         "中",
                                         "文",
                                         "日本",
                                         "한",
                                         "👍",
                                         "🏽",
                                         "😀",
                                         "\u200d",
                                         "\u00a0",
                                         "\u3000",
                                         "e\u0301",
                                         "<|im_start|>",
                                         "<|im_end|>",
                                         "<think>",
                                         "</think>",
                                         "<|endoftext|>",
                                         "{",
                                         "}",
                                         "()",
                                         "->",
                                         "😀😀",
                                         "1234",
                                         "\xf0\x9d\x94\xb8"};
  for (int iter = 0; iter < 300; ++iter) {
    std::string text;
    const int n = static_cast<int>(rng() % 40);
    for (int k = 0; k < n; ++k) text += pool[rng() % pool.size()];
    std::vector<std::int32_t> ids;
    std::vector<std::int64_t> starts;
    tok.encode_append(text, ids, &starts);
    ASSERT_EQ(ids, tok.encode(text));
    ASSERT_EQ(starts.size(), ids.size());
    ASSERT_EQ(tok.decode(ids), tok.normalize(text)) << "text: " << text;
    if (tok.normalize(text) != text) continue;  // offsets are exact for NFC text
    for (std::size_t i = 0; i < ids.size(); ++i) {
      const std::int64_t end =
          i + 1 < ids.size() ? starts[i + 1] : static_cast<std::int64_t>(text.size());
      ASSERT_LE(starts[i], end);
      ASSERT_EQ(text.substr(starts[i], end - starts[i]),
                tok.decode(std::vector<std::int32_t>{ids[i]}))
          << "token " << i << " of: " << text;
    }
  }
}

// Words too long for the cache and the scan merge (heap path), and a long whitespace run.
TEST(Qwen3Tokenizer, LongInputs) {
  QT_REQUIRE_QWEN3();
  const Tokenizer& tok = test::qwen3_tokenizer();
  std::mt19937_64 rng(test::test_seed());
  std::string word;
  for (int i = 0; i < 5000; ++i) word.push_back(static_cast<char>('a' + rng() % 26));
  EXPECT_EQ(tok.decode(tok.encode(word)), word);
  const std::string spaces(100000, ' ');
  EXPECT_EQ(tok.decode(tok.encode(spaces + "x" + spaces)), spaces + "x" + spaces);
}

// Tokens per second (printed; the bound only catches a pathological slowdown) on 1 MB of the
// fixture texts repeated (the word cache at work) and 1 MB of random vocabulary entries (mostly
// cache misses: the worst case).
TEST(Qwen3Tokenizer, Throughput) {
  QT_REQUIRE_QWEN3();
  const Tokenizer& tok = test::qwen3_tokenizer();
  const json fx = load_fixture();
  std::mt19937_64 rng(test::test_seed());
  std::string repeated, random;
  while (repeated.size() < (std::size_t{1} << 20)) {
    repeated += case_bytes(fx["texts"][rng() % fx["texts"].size()]);
    repeated += " Some ordinary English prose follows, with numbers like 2024 and words. ";
  }
  while (random.size() < (std::size_t{1} << 20)) {
    std::vector<std::int32_t> ids(64);
    for (auto& id : ids) id = static_cast<std::int32_t>(rng() % 151643);
    random += tok::utf8_repair(tok.decode(ids));
  }
  for (const auto& [name, corpus] :
       {std::pair<const char*, const std::string&>{"repeated texts", repeated},
        {"random vocabulary", random}}) {
    const auto t0 = std::chrono::steady_clock::now();
    std::size_t n = 0;
    for (std::size_t off = 0; off < corpus.size(); off += 4096)  // documents of 4 KB
      n += tok.encode(std::string_view(corpus).substr(off, 4096)).size();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("[ throughput ] %s: %.1f MB, %zu tokens in %.2f s: %.0f tokens/s, %.1f MB/s\n",
                name, corpus.size() / 1e6, n, s, n / s, corpus.size() / 1e6 / s);
    EXPECT_GT(n / s, 2e4) << name;
  }
}

}  // namespace
}  // namespace qt
