// Tokenizer pieces that need no downloaded file: tiny hand-made tokenizer.json files (both merge
// spellings, added tokens with lstrip/rstrip), one UserError naming file and key for each kind of
// bad file, the two BPE merge loops against each other, UTF-8 repair and the regex rewrite.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "qtrain/error.h"
#include "qtrain/tokenizer.h"
#include "support/random.h"
#include "tokenizer/bpe.h"
#include "tokenizer/text.h"

namespace qt {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

std::string byte_str(unsigned char b) {
  std::string s;
  tok::append_utf8(s, tok::byte_char(b));
  return s;
}

// A byte-level BPE over the 256 byte tokens (ids 0..255) with merges a+b, ab+c, Ġ+a.
json tiny_tokenizer(bool pair_merges) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_str(static_cast<unsigned char>(b))] = b;
  vocab["ab"] = 256;
  vocab["abc"] = 257;
  vocab["Ġa"] = 258;
  json merges = json::array();
  const std::vector<std::pair<std::string, std::string>> m = {{"a", "b"}, {"ab", "c"}, {"Ġ", "a"}};
  for (const auto& [a, b] : m)
    merges.push_back(pair_merges ? json::array({a, b}) : json(a + " " + b));
  return {
      {"version", "1.0"},
      {"added_tokens", json::array({{{"id", 259}, {"content", "<s>"}, {"special", true}},
                                    {{"id", 260},
                                     {"content", "<x>"},
                                     {"special", false},
                                     {"lstrip", true},
                                     {"rstrip", true}}})},
      {"normalizer", {{"type", "NFC"}}},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}}};
}

class TinyTokenizer : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/qtrain_tok_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path) << text;
    return path;
  }
  // The UserError message of loading `j` (fails the test when it loads).
  std::string load_error(const json& j) {
    const std::string path = write("tokenizer.json", j.dump());
    try {
      Tokenizer::from_file(path);
    } catch (const UserError& e) {
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
      return e.what();
    }
    ADD_FAILURE() << "loaded without error: " << j.dump().substr(0, 200);
    return "";
  }
  std::string dir_;
};

TEST_F(TinyTokenizer, BothMergeSpellingsAndAddedTokens) {
  for (bool pairs : {false, true}) {
    const Tokenizer tok = Tokenizer::from_file(write("t.json", tiny_tokenizer(pairs).dump()));
    EXPECT_EQ(tok.vocab_size(), 261);
    // "abc": a+b (rank 0), then ab+c. " ab": a+b ranks before Ġ+a, so Ġ stays alone.
    EXPECT_EQ(tok.encode("abc"), (std::vector<std::int32_t>{257}));
    EXPECT_EQ(tok.encode(" ab"), (std::vector<std::int32_t>{' ', 256}));
    EXPECT_EQ(tok.encode(" a"), (std::vector<std::int32_t>{258}));
    // <s> special; <x> takes the blanks around it.
    EXPECT_EQ(tok.encode("c<s>c"), (std::vector<std::int32_t>{'c', 259, 'c'}));
    EXPECT_EQ(tok.encode("c  <x>  c"), (std::vector<std::int32_t>{'c', 260, 'c'}));
    EXPECT_EQ(tok.encode("c<s>c", false).size(), 5u);
    EXPECT_EQ(tok.decode(tok.encode("abc <s> é\xff")), "abc <s> é\xEF\xBF\xBD");
  }
}

TEST_F(TinyTokenizer, DirectoryWithConfig) {
  write("tokenizer.json", tiny_tokenizer(false).dump());
  write("tokenizer_config.json",
        R"({"chat_template": "{{ x }}", "eos_token": {"content": "<s>"}})");
  const Tokenizer tok = Tokenizer::from_dir(dir_);
  EXPECT_EQ(tok.chat_template(), "{{ x }}");
  EXPECT_EQ(tok.eos_token(), "<s>");
  write("tokenizer_config.json", "{ not json");
  try {
    Tokenizer::from_dir(dir_);
    ADD_FAILURE() << "bad tokenizer_config.json accepted";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("tokenizer_config.json: not valid JSON"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(TinyTokenizer, BadFilesNameFileAndProblem) {
  auto expect_msg = [](const std::string& msg, const std::string& part) {
    EXPECT_NE(msg.find(part), std::string::npos) << "message: " << msg << "\nexpected: " << part;
  };
  try {
    Tokenizer::from_file(dir_ + "/missing.json");
    ADD_FAILURE();
  } catch (const UserError& e) {
    expect_msg(e.what(), "missing.json: no such file");
  }
  try {
    Tokenizer::from_dir(dir_);
    ADD_FAILURE();
  } catch (const UserError& e) {
    expect_msg(e.what(), "has no tokenizer.json");
  }
  try {
    Tokenizer::from_file(dir_);  // a directory where tokenizer.json was expected
    ADD_FAILURE();
  } catch (const UserError& e) {
    expect_msg(e.what(), dir_ + ": is a directory");
  }
  try {
    Tokenizer::from_file(write("bad.json", "{\"model\": [1, 2"));
    ADD_FAILURE();
  } catch (const UserError& e) {
    expect_msg(e.what(), "bad.json: not valid JSON");
  }
  json j = tiny_tokenizer(false);
  j["model"]["type"] = "Unigram";
  expect_msg(load_error(j), "model.type: 'Unigram' is not supported");
  j = tiny_tokenizer(false);
  j["model"]["merges"][1] = "ab";
  expect_msg(load_error(j), "model.merges[1]: 'ab' is not two tokens");
  j = tiny_tokenizer(false);
  j["model"]["merges"][2] = json::array({"Ġ", "zz"});
  expect_msg(load_error(j),
             "model.merges[2]: 'Ġ' + 'zz' uses or makes a token that is not in model.vocab");
  j = tiny_tokenizer(false);
  j["model"]["merges"][0] = 7;
  expect_msg(load_error(j), "model.merges[0]: expected");
  j = tiny_tokenizer(false);
  j["model"]["vocab"].erase(byte_str('q'));
  expect_msg(load_error(j), "has no token for byte 0x71");
  j = tiny_tokenizer(false);
  j["model"].erase("vocab");
  expect_msg(load_error(j), "model.vocab: missing");
  j = tiny_tokenizer(false);
  j["normalizer"] = {{"type", "NFKC"}};
  expect_msg(load_error(j), "normalizer: 'NFKC' is not supported");
  j = tiny_tokenizer(false);
  j["pre_tokenizer"] = {{"type", "Metaspace"}};
  expect_msg(load_error(j), "pre_tokenizer: 'Metaspace' is not supported");
  j = tiny_tokenizer(false);
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       json::array(
           {{{"type", "Split"}, {"pattern", {{"Regex", "(unclosed"}}}, {"behavior", "Isolated"}},
            {{"type", "ByteLevel"}, {"use_regex", false}}})}};
  expect_msg(load_error(j), "pre_tokenizer: pattern /(unclosed/: regex error");
  j = tiny_tokenizer(false);
  j["added_tokens"][0].erase("id");
  expect_msg(load_error(j), "added_tokens[0]: needs an integer id");
  j = tiny_tokenizer(false);
  j["model"]["vocab"]["ab"] = "x";
  expect_msg(load_error(j), "model.vocab: id of 'ab' must be an integer in [0, 4194304), got \"x\"");
  // A number beyond double's range is nlohmann's out_of_range, not a parse_error; it aborted
  // qtrain prep (found by tests/fuzz's tokenizer target, corpus regression_number_overflow.json).
  const std::string path = write("tokenizer.json", R"({"model": {"vocab": {"a": 1e999}}})");
  try {
    Tokenizer::from_file(path);
    ADD_FAILURE() << "a tokenizer.json with 1e999 loaded";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("tokenizer file " + path + ": not valid JSON"),
              std::string::npos)
        << e.what();
  }
}

// Ids out of range, of the wrong type or given twice: a UserError naming the file, the key and
// the id as written, never a crash or a huge allocation (issue 15, case 7).
TEST_F(TinyTokenizer, BadIdsAreUserErrorsNotCrashes) {
  struct Case {
    const char* what;
    std::function<void(json&)> edit;
    std::string expect;  // part of the message (the path is checked by load_error)
  };
  const std::vector<Case> cases = {
      {"added id beyond int32", [](json& j) { j["added_tokens"][0]["id"] = 3000000000LL; },
       "added_tokens[0]: id must be an integer in [0, 4194304), got 3000000000"},
      {"added id INT32_MAX", [](json& j) { j["added_tokens"][1]["id"] = 2147483647; },
       "added_tokens[1]: id must be an integer in [0, 4194304), got 2147483647"},
      {"added id UINT64_MAX",
       [](json& j) { j["added_tokens"][0]["id"] = std::numeric_limits<std::uint64_t>::max(); },
       "got 18446744073709551615"},
      {"added id negative", [](json& j) { j["added_tokens"][0]["id"] = -5; }, "got -5"},
      {"added id 2^31 + 5 (negative as int32)",
       [](json& j) { j["added_tokens"][0]["id"] = 2147483653LL; }, "got 2147483653"},
      {"added id fractional", [](json& j) { j["added_tokens"][0]["id"] = 259.5; },
       "added_tokens[0]: id must be an integer"},
      {"added id a string", [](json& j) { j["added_tokens"][0]["id"] = "259"; },
       "added_tokens[0]: id must be an integer"},
      {"added ids twice", [](json& j) { j["added_tokens"][1]["id"] = 259; },
       "added_tokens[1]: id 259 is also the id of added_tokens[0] ('<s>')"},
      {"added id of another vocabulary entry", [](json& j) { j["added_tokens"][0]["id"] = 256; },
       "added_tokens[0]: id 256 ('<s>') is already the id of model.vocab entry 'ab'"},
      {"vocab id beyond int32", [](json& j) { j["model"]["vocab"]["ab"] = 3000000000LL; },
       "model.vocab: id of 'ab' must be an integer in [0, 4194304), got 3000000000"},
      {"vocab id 2^30 (a 32 GB table before)",
       [](json& j) { j["model"]["vocab"]["ab"] = 1 << 30; }, "got 1073741824"},
      {"vocab id negative", [](json& j) { j["model"]["vocab"]["ab"] = -1; }, "got -1"},
      {"vocab id fractional", [](json& j) { j["model"]["vocab"]["ab"] = 1.0; }, "got 1.0"},
      {"vocab ids twice", [](json& j) { j["model"]["vocab"]["ab"] = 97; },
       "model.vocab: 'a' and 'ab' have the same id 97"},
      {"vocab not an object", [](json& j) { j["model"]["vocab"] = json::array({1}); },
       "model.vocab: missing or not an object"},
      {"added token not an object", [](json& j) { j["added_tokens"][0] = 5; },
       "added_tokens[0]: needs an integer id"},
      {"special flag a string", [](json& j) { j["added_tokens"][0]["special"] = "yes"; },
       "unexpected structure"},
      {"pre-tokenizer steps not objects",
       [](json& j) {
         j["pre_tokenizer"] = {{"type", "Sequence"}, {"pretokenizers", json::array({5})}};
       },
       "unexpected structure"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    json j = tiny_tokenizer(false);
    c.edit(j);
    const std::string msg = load_error(j);
    EXPECT_NE(msg.find(c.expect), std::string::npos) << "message: " << msg
                                                     << "\nexpected: " << c.expect;
  }
  // An added token may repeat a vocabulary entry under its id (GPT-2's <|endoftext|>).
  json j = tiny_tokenizer(false);
  j["added_tokens"].push_back({{"id", 256}, {"content", "ab"}, {"special", true}});
  const Tokenizer tok = Tokenizer::from_file(write("same.json", j.dump()));
  EXPECT_EQ(tok.vocab_size(), 261);
  EXPECT_EQ(tok.encode("ab"), (std::vector<std::int32_t>{256}));
}

// tokenizer_config.json values of the wrong type: a UserError naming that file and the key, never
// an exception that escapes (a crash); null stands for absent.
TEST_F(TinyTokenizer, BadConfigTypesAreUserErrors) {
  write("tokenizer.json", tiny_tokenizer(false).dump());
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"chat_template": [{"name": 5, "template": "x"}]})",
       "chat_template[0]: expected {\"name\": string, \"template\": string}"},
      {R"({"chat_template": [{"name": "default", "template": 7}]})", "chat_template[0]: expected"},
      {R"({"chat_template": [3]})", "chat_template[0]: expected"},
      {R"({"chat_template": 3})", "chat_template: expected a string or a list"},
      {R"({"eos_token": 3})", "eos_token: expected a string or {\"content\": string}"},
      {R"({"eos_token": {"content": 3}})", "eos_token: expected"},
      {R"([1, 2])", "expected a JSON object"},
  };
  for (const auto& [config, expect] : cases) {
    SCOPED_TRACE(config);
    const std::string path = write("tokenizer_config.json", config);
    try {
      Tokenizer::from_dir(dir_);
      ADD_FAILURE() << "loaded without error";
    } catch (const UserError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("tokenizer config " + path + ": " + expect), std::string::npos) << msg;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a UserError: " << e.what();
    }
  }
  write("tokenizer_config.json", R"({"chat_template": null, "eos_token": null})");
  EXPECT_EQ(Tokenizer::from_dir(dir_).eos_token(), "");
}

// The heap merge (long words) and the scan merge (short words) agree on random merge tables.
TEST(Bpe, ScanAndHeapMergesAgree) {
  std::mt19937_64 rng(test::test_seed());
  for (int trial = 0; trial < 20; ++trial) {
    const int alphabet = 2 + static_cast<int>(rng() % 4);
    tok::MergeTable table;
    int next_id = alphabet, rank = 0;
    std::vector<int> ids(alphabet);
    for (int i = 0; i < alphabet; ++i) ids[i] = i;
    for (int k = 0; k < 40; ++k) {  // merges of random existing symbols
      const int a = ids[rng() % ids.size()], b = ids[rng() % ids.size()];
      if (table.insert(a, b, {rank, next_id})) {
        ids.push_back(next_id++);
        ++rank;
      }
    }
    for (int w = 0; w < 50; ++w) {
      std::vector<std::int32_t> word(1 + rng() % 200);
      for (auto& x : word) x = static_cast<std::int32_t>(rng() % alphabet);
      auto scan = word, heap = word;
      tok::bpe_merge_scan(table, scan);
      tok::bpe_merge_heap(table, heap);
      ASSERT_EQ(scan, heap) << "trial " << trial << " word " << w;
    }
  }
}

TEST(TokenizerText, Utf8RepairFollowsMaximalSubparts) {
  const std::string fffd = "\xEF\xBF\xBD";
  EXPECT_EQ(tok::utf8_repair("ok"), "ok");
  EXPECT_EQ(tok::utf8_repair("\xff"), fffd);
  EXPECT_EQ(tok::utf8_repair("\xe2\x82"), fffd);  // truncated: one U+FFFD
  EXPECT_EQ(tok::utf8_repair("\xe2\x82 "), fffd + " ");
  EXPECT_EQ(tok::utf8_repair("\xc0\xaf"), fffd + fffd);             // C0 never starts a sequence
  EXPECT_EQ(tok::utf8_repair("\xed\xa0\x80"), fffd + fffd + fffd);  // surrogate
  EXPECT_EQ(tok::utf8_repair("\xf4\x90\x80\x80"), fffd + fffd + fffd + fffd);  // above U+10FFFF
  EXPECT_EQ(tok::utf8_repair("\xf0\x9f\x98"), fffd);
  EXPECT_EQ(tok::utf8_repair("\xf0\x9f\x98\x80"), "\xf0\x9f\x98\x80");
  EXPECT_TRUE(tok::utf8_valid("h\xc3\xa9"));
  EXPECT_FALSE(tok::utf8_valid("h\xc3"));
}

TEST(TokenizerText, RegexRewriteAndSplit) {
  const std::string p = tok::onig_to_pcre2(R"(\s+(?!\S)|[^\s\p{L}]+|[\]\s]|\\s)");
  EXPECT_EQ(p.find("\\s"), p.rfind("\\\\s") + 1);  // only the escaped backslash + s is left
  EXPECT_EQ(p.find("\\S"), std::string::npos);
  EXPECT_THROW(tok::onig_to_pcre2(R"([\S])"), std::invalid_argument);
  tok::Regex re(tok::onig_to_pcre2(R"(\p{L}+|\s+)"));
  std::vector<std::pair<std::size_t, std::size_t>> pieces;
  const std::string s =
      "ab  c\xc2\x85"
      "d!!";  // U+0085 is whitespace for Oniguruma
  re.split(s, pieces);
  const std::vector<std::pair<std::size_t, std::size_t>> want = {{0, 2}, {2, 4}, {4, 5},
                                                                 {5, 7}, {7, 8}, {8, 10}};
  EXPECT_EQ(pieces, want);
}

TEST(TokenizerText, ByteLevelAlphabet) {
  EXPECT_EQ(tok::byte_char('a'), U'a');
  EXPECT_EQ(tok::byte_char(' '), U'\u0120');   // Ġ
  EXPECT_EQ(tok::byte_char('\n'), U'\u010A');  // Ċ
  std::string all, back;
  for (int b = 0; b < 256; ++b) tok::append_utf8(all, tok::byte_char(static_cast<std::uint8_t>(b)));
  ASSERT_TRUE(tok::byte_level_decode(all, back));
  ASSERT_EQ(back.size(), 256u);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(static_cast<unsigned char>(back[b]), b);
  EXPECT_FALSE(tok::byte_level_decode("中", back));
}

}  // namespace
}  // namespace qt
