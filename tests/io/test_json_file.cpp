// io::read_json_file / read_text_file / parse_json: every error is a UserError naming the file.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "io/json_file.h"
#include "qtrain/error.h"

namespace fs = std::filesystem;

namespace qt {
namespace {

class JsonFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/qtrain_json_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& text) {
    const std::string p = dir_ + "/" + name;
    std::ofstream(p, std::ios::binary) << text;
    return p;
  }
  // The message of the UserError that f throws ("" and a failure when none).
  template <class F>
  std::string error_of(F f) {
    try {
      f();
    } catch (const UserError& e) {
      return e.what();
    }
    ADD_FAILURE() << "no UserError";
    return "";
  }
  std::string dir_;
};

TEST_F(JsonFileTest, ReadsAndParses) {
  const std::string p = write("a.json", R"({"eos_token_id": [1, 2]})");
  EXPECT_EQ(io::read_json_file(p)["eos_token_id"], nlohmann::json({1, 2}));
  EXPECT_EQ(io::read_text_file(write("t.txt", "x\ny")), "x\ny");
}

TEST_F(JsonFileTest, ErrorsNameTheFile) {
  const std::string missing = dir_ + "/missing.json";
  EXPECT_EQ(error_of([&] { io::read_json_file(missing); }), missing + ": no such file");
  EXPECT_EQ(error_of([&] { io::read_json_file(missing, "tokenizer file"); }),
            "tokenizer file " + missing + ": no such file");
  EXPECT_EQ(error_of([&] { io::read_text_file(dir_); }), dir_ + ": is a directory");
  const std::string bad = write("bad.json", "{\"a\": [1, 2");
  EXPECT_EQ(error_of([&] { io::read_json_file(bad); }).rfind(bad + ": not valid JSON (", 0), 0u);
  const std::string huge = write("huge.json", "{\"a\": 1e999}");
  EXPECT_EQ(error_of([&] { io::read_json_file(huge, "config"); })
                .rfind("config " + huge + ": not valid JSON (", 0), 0u);
}

}  // namespace
}  // namespace qt
