// The text commands of the dsv4 CLI as users run them: tokenize / detokenize / render output
// formats and one-line errors, and generate / logits taking --prompt / --messages through the
// model directory's tokenizer.json (same tokens as the equivalent --prompt-ids).
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>

#include "test_support.h"
#include "tokenizer/prompt_encoder.h"
#include "tokenizer/utf8.h"

namespace dsv4::tok::test {
namespace {

struct Result {
  int code = -1;
  std::string out, err;
};

class TokenizerCli : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { tmp_ = new std::string(make_temp_dir()); }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*tmp_);
    delete tmp_;
  }
  static std::string tmp(const std::string& name) { return *tmp_ + "/" + name; }

  // Runs `dsv4 ARGS` (ARGS already shell-quoted where needed).
  static Result dsv4(const std::string& args) {
    Result r;
    const std::string err = tmp("stderr.txt");
    FILE* p = popen((std::string(DSV4_CLI) + " " + args + " 2>" + err).c_str(), "r");
    std::array<char, 4096> buf{};
    size_t n;
    while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
    const int st = pclose(p);
    r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    r.err = read_file(err);
    return r;
  }
  static std::string quote(const std::string& s) {
    std::string q = "'";
    for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return q + "'";
  }
  // A failure: non-zero exit, one line on stderr naming the command.
  static void expect_error(const Result& r, const std::string& command, const std::string& what) {
    EXPECT_NE(r.code, 0);
    EXPECT_EQ(r.err.rfind("dsv4 " + command + ": error: ", 0), 0u) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find(what), std::string::npos) << r.err;
  }
  static std::string* tmp_;
};
std::string* TokenizerCli::tmp_ = nullptr;

class V4Cli : public TokenizerCli {
 protected:
  void SetUp() override {
    if (tokenizer_dir().empty())
      GTEST_SKIP() << "DeepSeek-V4 tokenizer.json not found (set DSV4_TOKENIZER_DIR)";
  }
  static std::string tokenizer() { return tokenizer_dir() + "/tokenizer.json"; }
  static std::string official(const std::string& name) {
    return tokenizer_dir() + "/encoding_tests/official/" + name;
  }
};

TEST_F(V4Cli, TokenizePrintsIdsOnOneLine) {
  // HF-Rust golden ids (render_vectors.json, text_cases_cross_checked).
  const Result r = dsv4("tokenize --tokenizer " + tokenizer() + " --text 'Hello, world!'");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "19923,14,2058,3\n");
  write_file(tmp("text.txt"), "<｜User｜>Hi<｜Assistant｜></think>");
  const Result f = dsv4("tokenize --tokenizer " + tokenizer_dir() + " --file " + tmp("text.txt"));
  ASSERT_EQ(f.code, 0) << f.err;
  EXPECT_EQ(f.out, "128803,23166,128804,128822\n");
  EXPECT_EQ(dsv4("tokenize --tokenizer " + tokenizer() + " --text ''").out, "\n");
}

TEST_F(TokenizerCli, TokenizeReplacesInvalidUtf8AndWarns) {
  write_file(tmp("tiny.json"), tiny_tokenizer_json());
  write_file(tmp("bad.txt"), "ab\xFF\xC0");
  const Result r = dsv4("tokenize --tokenizer " + tmp("tiny.json") + " --file " + tmp("bad.txt"));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, "256,239,191,189,239,191,189\n");  // ab, then U+FFFD (EF BF BD) twice
  EXPECT_NE(r.err.find("warning: the text is not valid UTF-8; 2 ill-formed"), std::string::npos)
      << r.err;
}

TEST_F(V4Cli, DetokenizeInvertsTokenize) {
  const std::string text = "Tabs\tand 中文, emoji 😀 and <think>tags</think>\n";
  write_file(tmp("rt.txt"), text);
  const Result ids = dsv4("tokenize --tokenizer " + tokenizer() + " --file " + tmp("rt.txt"));
  ASSERT_EQ(ids.code, 0) << ids.err;
  const std::string list = ids.out.substr(0, ids.out.size() - 1);
  const Result back = dsv4("detokenize --tokenizer " + tokenizer() + " --ids " + list);
  ASSERT_EQ(back.code, 0) << back.err;
  EXPECT_EQ(back.out, text);
  EXPECT_EQ(
      dsv4("detokenize --tokenizer " + tokenizer() + " --ids 0,19923,1 --skip-special-tokens").out,
      "Hello");
}

TEST_F(V4Cli, RenderMatchesTheOfficialFixtures) {
  const char* modes[] = {"thinking", "thinking", "thinking", "chat"};
  for (int i = 1; i <= 4; ++i) {
    const std::string n = std::to_string(i);
    const Result r = dsv4("render --messages " + official("test_input_" + n + ".json") +
                          " --mode " + modes[i - 1]);
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(r.out, read_file(official("test_output_" + n + ".txt"))) << "fixture " << i;
  }
}

TEST_F(V4Cli, RenderTakesEffortAndToolsFlags) {
  const ordered_json v =
      ordered_json::parse(read_file(tokenizer_dir() + "/encoding_tests/render_vectors.json"));
  for (const auto& c : v["render_cases"]) {
    if (c["name"] == "thinking_effort_max") {
      write_file(tmp("m.json"), c["messages"].dump());
      const Result r =
          dsv4("render --messages " + tmp("m.json") + " --mode thinking --reasoning-effort max");
      EXPECT_EQ(r.out, c["rendered"].get<std::string>()) << r.err;
    }
    if (c["name"] == "tool_call_chat_mode") {  // [system "" + tools, ...]: --tools adds it
      ordered_json messages = c["messages"];
      ASSERT_EQ(messages[0]["role"], "system");
      ASSERT_EQ(messages[0]["content"], "");
      write_file(tmp("tools.json"), messages[0]["tools"].dump());
      messages.erase(messages.begin());
      write_file(tmp("m.json"), messages.dump());
      const Result r = dsv4("render --messages " + tmp("m.json") + " --tools " + tmp("tools.json"));
      EXPECT_EQ(r.out, c["rendered"].get<std::string>()) << r.err;
    }
  }
}

TEST_F(TokenizerCli, BadInputGivesOneLineErrors) {
  write_file(tmp("ok.json"), R"([{"role": "user", "content": "hi"}])");
  write_file(tmp("broken.json"), R"([{"role": "user", "content": )");
  write_file(tmp("role.json"), R"([{"role": "wizard", "content": "hi"}])");
  expect_error(dsv4("render --messages " + tmp("ok.json") + " --frobnicate 1"), "render",
               "unknown flag '--frobnicate'");
  expect_error(dsv4("render --messages " + tmp("missing.json")), "render", "cannot open");
  expect_error(dsv4("render --messages " + tmp("broken.json")), "render", "invalid JSON");
  expect_error(dsv4("render --messages " + tmp("role.json")), "render", "unknown message role");
  expect_error(dsv4("render --messages " + tmp("ok.json") + " --mode deep"), "render",
               "--mode: 'deep' is not one of chat, thinking");
  expect_error(dsv4("render --messages " + tmp("ok.json") + " --reasoning-effort extreme"),
               "render", "--reasoning-effort: 'extreme' is not one of high, max");
  expect_error(dsv4("render --messages " + tmp("ok.json") + " --tools " + tmp("broken.json")),
               "render", "invalid JSON");
  expect_error(dsv4("render"), "render", "missing required flag --messages");
  write_file(tmp("tiny.json"), tiny_tokenizer_json());
  expect_error(dsv4("tokenize --tokenizer " + tmp("tiny.json")), "tokenize", "exactly one of");
  expect_error(dsv4("tokenize --tokenizer " + tmp("nope.json") + " --text x"), "tokenize",
               "cannot open tokenizer file");
  expect_error(dsv4("tokenize --tokenizer " + tmp("broken.json") + " --text x"), "tokenize",
               "invalid JSON");
  expect_error(dsv4("tokenize --tokenizer " + tmp("tiny.json") + " --file " + tmp("nope.txt")),
               "tokenize", "cannot open text file");
  expect_error(dsv4("detokenize --tokenizer " + tmp("tiny.json") + " --ids 1,x"), "detokenize",
               "'x' is not a token id");
  expect_error(dsv4("detokenize --tokenizer " + tmp("tiny.json") + " --ids 5000"), "detokenize",
               "not in the vocabulary");
}

// generate / logits on a tiny random model whose directory holds the tiny test tokenizer (its
// ids fit the tiny vocabulary).
class TextPromptCli : public TokenizerCli {
 protected:
  static void SetUpTestSuite() {
    TokenizerCli::SetUpTestSuite();
    const Result r = dsv4("make-tiny --preset flash --format mxfp4 --seed 3 --out " + model());
    ASSERT_EQ(r.code, 0) << r.err;
    write_file(model() + "/tokenizer.json", tiny_tokenizer_json());
    write_file(tmp("chat.json"), R"({"thinking_mode": "thinking", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "abc abab"}]})");
  }
  static std::string model() { return tmp("model"); }
  static std::string ids_of(const std::string& text_file) {
    const Result r = dsv4("tokenize --tokenizer " + model() + " --file " + text_file);
    EXPECT_EQ(r.code, 0) << r.err;
    return r.out.substr(0, r.out.size() - 1);
  }
};

TEST_F(TextPromptCli, GenerateWithPromptEqualsItsIds) {
  write_file(tmp("p.txt"), "<｜begin▁of▁sentence｜>abc abab");
  const std::string ids = ids_of(tmp("p.txt"));
  EXPECT_EQ(ids, "266,258,32,256,256");  // BOS, abc, ' ', ab, ab (tiny tokenizer's merges)
  const Result a =
      dsv4("generate --model " + model() + " --prompt-ids " + ids + " --max-new-tokens 4");
  const Result b = dsv4("generate --model " + model() + " --prompt " +
                        quote("<｜begin▁of▁sentence｜>abc abab") + " --max-new-tokens 4");
  ASSERT_EQ(a.code, 0) << a.err;
  ASSERT_EQ(b.code, 0) << b.err;
  EXPECT_EQ(a.out, b.out);
}

TEST_F(TextPromptCli, MessagesAreRenderedThenTokenized) {
  const Result rendered = dsv4("render --messages " + tmp("chat.json"));
  ASSERT_EQ(rendered.code, 0) << rendered.err;
  EXPECT_EQ(rendered.out,
            "<｜begin▁of▁sentence｜>Be brief.<｜User｜>abc abab<｜Assistant｜><think>");
  write_file(tmp("rendered.txt"), rendered.out);
  const std::string ids = ids_of(tmp("rendered.txt"));
  const Result a =
      dsv4("generate --model " + model() + " --prompt-ids " + ids + " --max-new-tokens 3");
  const Result b = dsv4("generate --model " + model() + " --messages " + tmp("chat.json") +
                        " --max-new-tokens 3");
  ASSERT_EQ(b.code, 0) << b.err;
  EXPECT_EQ(a.out, b.out);
  const Result la =
      dsv4("logits --model " + model() + " --prompt-ids " + ids + " --out " + tmp("a.safetensors"));
  const Result lb = dsv4("logits --model " + model() + " --messages " + tmp("chat.json") +
                         " --out " + tmp("b.safetensors"));
  ASSERT_EQ(lb.code, 0) << lb.err;
  EXPECT_EQ(read_file(tmp("a.safetensors")), read_file(tmp("b.safetensors")));
}

TEST_F(TextPromptCli, TextPromptsAreExclusiveAndNeedATokenizer) {
  expect_error(dsv4("generate --model " + model() + " --prompt x --prompt-ids 1"), "generate",
               "exactly one of");
  expect_error(dsv4("generate --model " + model() + " --prompt x --messages " + tmp("chat.json")),
               "generate", "exactly one of");
  expect_error(dsv4("logits --model " + model() + " --messages " + tmp("chat.json") +
                    " --prompt-file " + tmp("chat.json") + " --out " + tmp("x.safetensors")),
               "logits", "exactly one of");
  expect_error(dsv4("generate --model " + model() + " --prompt ''"), "generate", "prompt is empty");
  expect_error(dsv4("generate --model " + model() + " --messages " + tmp("missing.json")),
               "generate", "cannot open");
  const std::string bare = tmp("bare");
  ASSERT_EQ(dsv4("make-tiny --preset flash --format mxfp4 --seed 3 --out " + bare).code, 0);
  expect_error(dsv4("generate --model " + bare + " --prompt hi"), "generate",
               "has no tokenizer.json");
}

}  // namespace
}  // namespace dsv4::tok::test
