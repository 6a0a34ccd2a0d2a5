// The DeepSeek-V4 prompt encoder and completion parser against the official encoder's outputs
// (the 4 official fixtures, the 22 render vectors with their token ids, the 2 parse vectors),
// encode -> parse round trips, the streaming parser fed one character at a time, and the
// Python-style JSON the prompts embed.
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "test_support.h"
#include "tokenizer/chat_format.h"
#include "tokenizer/completion_parser.h"
#include "tokenizer/prompt_encoder.h"
#include "tokenizer/python_json.h"
#include "tokenizer/streaming_parser.h"
#include "tokenizer/utf8.h"

namespace dsv4::tok::test {
namespace {

using chat::ThinkingMode;

ordered_json parse_json(const std::string& text) {
  return ordered_json::parse(text);
}

std::string encoding_tests_dir() {
  const std::string dir = tokenizer_dir();
  return dir.empty() ? dir : dir + "/encoding_tests";
}

// Tests on the official vectors in ../shared/tokenizer/deepseek-v4/encoding_tests.
class OfficialVectors : public ::testing::Test {
 protected:
  void SetUp() override {
    if (encoding_tests_dir().empty())
      GTEST_SKIP() << "../shared/tokenizer/deepseek-v4 (encoding_tests) not found (set "
                      "DSV4_TOKENIZER_DIR)";
  }
};

// ---- Python-style JSON ----------------------------------------------------------------------

TEST(PythonJson, FloatsAsPythonRepr) {
  const std::vector<std::pair<double, const char*>> cases = {
      {1.0, "1.0"},
      {1e16, "1e+16"},
      {1e-5, "1e-05"},
      {0.0001, "0.0001"},
      {123456789012345680.0, "1.2345678901234568e+17"},
      {-0.0, "-0.0"},
      {0.1, "0.1"},
      {1.0 / 3, "0.3333333333333333"},
      {5e-324, "5e-324"},
      {1.7976931348623157e308, "1.7976931348623157e+308"},
      {1234567890123456.0, "1234567890123456.0"},
      {100.0, "100.0"},
      {1e22, "1e+22"},
      {0.000123, "0.000123"},
      {NAN, "NaN"},
      {-INFINITY, "-Infinity"}};
  for (const auto& [v, want] : cases) EXPECT_EQ(python_float_repr(v), want) << want;
}

TEST(PythonJson, DumpsLikeJsonDumpsEnsureAsciiFalse) {
  const ordered_json v = parse_json(
      R"({"a": [1, 2.5, true, null], "b": {}, "c": "\u0001\u007f\u00e9\"\\\n\u2028", "z": 1e2})");
  EXPECT_EQ(
      python_json_dumps(v),
      "{\"a\": [1, 2.5, true, null], \"b\": {}, \"c\": \"\\u0001\x7f\u00e9\\\"\\\\\\n\u2028\", "
      "\"z\": 100.0}");
}

// ---- rendering ------------------------------------------------------------------------------

TEST_F(OfficialVectors, RenderOfficialFixtures) {
  const ThinkingMode modes[] = {ThinkingMode::kThinking, ThinkingMode::kThinking,
                                ThinkingMode::kThinking, ThinkingMode::kChat};
  for (int i = 1; i <= 4; ++i) {
    const std::string dir = encoding_tests_dir() + "/official/";
    ordered_json input = parse_json(read_file(dir + "test_input_" + std::to_string(i) + ".json"));
    ordered_json messages = input;
    if (input.is_object()) {  // fixture 1: the tools go onto the first message
      messages = input["messages"];
      messages[0]["tools"] = input["tools"];
    }
    EncodeOptions opt;
    opt.mode = modes[i - 1];
    EXPECT_EQ(encode_messages(messages, opt),
              read_file(dir + "test_output_" + std::to_string(i) + ".txt"))
        << "official fixture " << i;
  }
}

TEST_F(OfficialVectors, RenderEveryRenderVectorStringAndIds) {
  const ordered_json v = parse_json(read_file(encoding_tests_dir() + "/render_vectors.json"));
  ASSERT_EQ(v["render_cases"].size(), 22u);
  const Tokenizer* tok = shared_tokenizer();
  ASSERT_NE(tok, nullptr);
  for (const auto& c : v["render_cases"]) {
    const auto& o = c["options"];
    EncodeOptions opt;
    opt.mode = chat::parse_thinking_mode(o["thinking_mode"].get<std::string>());
    if (o.contains("reasoning_effort")) opt.reasoning_effort = o["reasoning_effort"];
    if (o.contains("drop_thinking")) opt.drop_thinking = o["drop_thinking"];
    const std::string rendered = encode_messages(c["messages"], opt);
    EXPECT_EQ(rendered, c["rendered"].get<std::string>()) << c["name"];
    EXPECT_EQ(tok->encode(rendered), c["token_ids"].get<std::vector<int32_t>>()) << c["name"];
  }
}

TEST(Render, ContextIsNotWrittenAgain) {
  // A conversation encoded in two steps (the second with the first as context) gives the same
  // text as in one step when it is cut after an assistant turn: no BOS, no repeated turns.
  const ordered_json conv = parse_json(R"([
    {"role": "system", "content": "S", "tools": [{"type": "function", "function": {"name": "f"}}]},
    {"role": "user", "content": "U1"},
    {"role": "assistant", "reasoning_content": "R1", "content": "",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "T1"},
    {"role": "assistant", "reasoning_content": "R2", "content": "A2"},
    {"role": "user", "content": "U2"}])");
  for (ThinkingMode mode : {ThinkingMode::kChat, ThinkingMode::kThinking}) {
    for (size_t cut : {3u, 5u}) {
      EncodeOptions whole, first, second;
      whole.mode = first.mode = second.mode = mode;
      first.reasoning_effort = second.reasoning_effort = whole.reasoning_effort = "max";
      const ordered_json head(conv.begin(), conv.begin() + long(cut));
      const ordered_json tail(conv.begin() + long(cut), conv.end());
      second.context = head;
      EXPECT_EQ(encode_messages(head, first) + encode_messages(tail, second),
                encode_messages(conv, whole))
          << "cut " << cut;
      EXPECT_EQ(encode_messages(tail, second).find(chat::kBos), std::string::npos);
    }
  }
}

TEST(Render, RejectsWhatTheOfficialEncoderRejects) {
  auto render = [](const char* messages, const char* effort = nullptr) {
    EncodeOptions opt;
    opt.mode = ThinkingMode::kThinking;
    if (effort) opt.reasoning_effort = effort;
    return encode_messages(parse_json(messages), opt);
  };
  EXPECT_THROW(render(R"([{"role": "robot", "content": "x"}])"), Error);
  EXPECT_THROW(render(R"([{"role": "user", "content": "x", "task": "dance"}])"), Error);
  EXPECT_THROW(render(R"([{"role": "developer", "content": ""}])"), Error);
  EXPECT_THROW(render(R"([{"role": "user", "content": "x"}])", "medium"), Error);
  EXPECT_THROW(render(R"([{"role": "user", "content": ["a", "b"]}])"), Error);
  EXPECT_THROW(render(R"([{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}])"),
               Error);
  EXPECT_THROW(render(R"([{"role": "assistant", "content": "", "tool_calls":
      [{"function": {"name": "f", "arguments": "[1, 2]"}}]}])"),
               Error);
  EXPECT_THROW(render(R"({"role": "user"})"), Error);
  EXPECT_THROW(chat::parse_thinking_mode("deep"), Error);
  EXPECT_THROW(parse_reasoning_effort("xhigh"), Error);
  EXPECT_EQ(parse_reasoning_effort("none"), std::nullopt);
}

TEST(Render, NonJsonArgumentsBecomeOneParameter) {
  const ordered_json m = parse_json(R"([{"role": "user", "content": "q"},
    {"role": "assistant", "content": "", "tool_calls":
      [{"function": {"name": "f", "arguments": "not json"}}]}])");
  const std::string out = encode_messages(m);
  EXPECT_NE(out.find("<｜DSML｜parameter name=\"arguments\" string=\"true\">not json"
                     "</｜DSML｜parameter>"),
            std::string::npos);
}

// ---- parsing --------------------------------------------------------------------------------

// Feeds `text` one UTF-8 character at a time (or all at once); returns the concatenated
// deltas, checking on the way that no delta holds DSML or half a character.
ParsedCompletion stream_parse(const std::string& text, ThinkingMode mode, bool whole = false) {
  StreamingCompletionParser p(mode);
  ParsedCompletion joined;
  auto add = [&](const StreamingCompletionParser::Delta& d) {
    joined.reasoning_content += d.reasoning;
    joined.content += d.content;
    joined.tool_calls.insert(joined.tool_calls.end(), d.tool_calls.begin(), d.tool_calls.end());
    for (const std::string* s : {&d.reasoning, &d.content}) {
      EXPECT_EQ(s->find(chat::kDsml), std::string::npos) << "DSML leaked: " << *s;
      EXPECT_TRUE(is_valid_utf8(*s)) << "half a character returned";
    }
  };
  for (size_t i = 0; i < text.size();) {
    const size_t n = whole ? text.size() : utf8_step(std::string_view(text).substr(i)).length;
    add(p.feed(std::string_view(text).substr(i, n)));
    i += n;
  }
  add(p.finish());
  EXPECT_EQ(joined, p.result());
  return joined;
}

// The streaming parser gives the batch parser's result, fed by characters or all at once.
ParsedCompletion parse_both_ways(const std::string& text, ThinkingMode mode) {
  const ParsedCompletion batch = parse_completion(text, mode);
  EXPECT_EQ(stream_parse(text, mode), batch) << text;
  EXPECT_EQ(stream_parse(text, mode, /*whole=*/true), batch) << text;
  return batch;
}

TEST_F(OfficialVectors, ParseVectors) {
  const ordered_json v = parse_json(read_file(encoding_tests_dir() + "/render_vectors.json"));
  ASSERT_EQ(v["parse_cases"].size(), 2u);
  for (const auto& c : v["parse_cases"]) {
    const ThinkingMode mode = chat::parse_thinking_mode(c["thinking_mode"].get<std::string>());
    const std::string text = c["completion"];
    EXPECT_EQ(parse_both_ways(text, mode).to_json(), c["parsed"]) << c["name"];
  }
}

// What the model writes for `assistant` after the prompt of `history` (the text the encoder
// adds for that turn), so that parsing it must give the assistant message back.
std::string completion_for(const ordered_json& history, const ordered_json& assistant,
                           ThinkingMode mode) {
  EncodeOptions opt;
  opt.mode = mode;
  ordered_json with = history;
  with.push_back(assistant);
  const std::string prompt = encode_messages(history, opt), full = encode_messages(with, opt);
  EXPECT_EQ(full.compare(0, prompt.size(), prompt), 0);
  return full.substr(prompt.size());
}

void expect_round_trip(const ordered_json& assistant, ThinkingMode mode) {
  const ordered_json history = parse_json(R"([{"role": "user", "content": "Q"}])");
  const std::string completion = completion_for(history, assistant, mode);
  const ParsedCompletion batch = parse_both_ways(completion, mode);
  EXPECT_EQ(batch.content, assistant.value("content", "")) << completion;
  const std::string reasoning = assistant.value("reasoning_content", "");
  EXPECT_EQ(batch.reasoning_content, mode == ThinkingMode::kThinking ? reasoning : "");
  const ordered_json calls = assistant.value("tool_calls", ordered_json::array());
  ASSERT_EQ(batch.tool_calls.size(), calls.size()) << completion;
  for (size_t i = 0; i < calls.size(); ++i) {
    EXPECT_EQ(batch.tool_calls[i].name, calls[i]["function"]["name"]);
    EXPECT_EQ(parse_json(batch.tool_calls[i].arguments),
              parse_json(calls[i]["function"]["arguments"].get<std::string>()))
        << batch.tool_calls[i].arguments;
  }
}

TEST(Parse, RoundTripsWhatTheEncoderWrites) {
  const char* assistants[] = {
      R"({"role": "assistant", "content": "Plain answer.", "reasoning_content": "Think."})",
      R"({"role": "assistant", "content": "", "reasoning_content": "",
          "tool_calls": [{"function": {"name": "now", "arguments": "{}"}}]})",
      R"({"role": "assistant", "content": "Checking both.\n\n", "reasoning_content": "Two calls.",
          "tool_calls": [
            {"function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
            {"function": {"name": "get_weather", "arguments":
              "{\"city\": \"Rome\", \"days\": 1, \"opts\": {\"units\": \"C\", \"alerts\": true}, \"tags\": [\"x\", 2.5], \"note\": null}"}}]})",
      R"({"role": "assistant", "content": "a < b and c｜d, \"quoted\" <｜User",
          "reasoning_content": "中文推理：先想一想。\n\n第二段。",
          "tool_calls": [{"function": {"name": "write_file", "arguments":
            "{\"path\": \"/tmp/x.txt\", \"text\": \"line 1\\nline 2 <tag> </｜DSML｜\\\"q\\\"\", \"mode\": \"w\"}"}}]})",
      R"({"role": "assistant", "content": "Emoji 😀👍🏽 and 🇯🇵 \n\n\n", "reasoning_content": "ok"})",
  };
  for (const char* a : assistants) {
    for (ThinkingMode mode : {ThinkingMode::kChat, ThinkingMode::kThinking}) {
      SCOPED_TRACE(a);
      expect_round_trip(parse_json(a), mode);
    }
  }
}

TEST(Parse, StreamingHoldsBackOnlyPossibleTags) {
  StreamingCompletionParser p(ThinkingMode::kChat);
  EXPECT_EQ(p.feed("Hello").content, "Hello");
  EXPECT_EQ(p.feed("\n\n<｜DSM").content, "");    // may start the tool-call block
  EXPECT_EQ(p.feed("x").content, "\n\n<｜DSMx");  // it did not
  EXPECT_EQ(p.feed(" <｜end▁of").content, " ");   // may be EOS
  EXPECT_EQ(p.feed("▁sentence｜>").content, "");
  EXPECT_TRUE(p.ended());
  EXPECT_EQ(p.result().content, "Hello\n\n<｜DSMx ");
  EXPECT_THROW(p.feed("more"), Error);
}

TEST(Parse, StreamingEmitsToolCallsAsTheyClose) {
  const std::string text =
      "Let me check.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"a\">\n"
      "<｜DSML｜parameter name=\"k\" string=\"true\">v</｜DSML｜parameter>\n"
      "</｜DSML｜invoke>\n<｜DSML｜invoke name=\"b\">\n\n</｜DSML｜invoke>\n"
      "</｜DSML｜tool_calls><｜end▁of▁sentence｜>";
  StreamingCompletionParser p(ThinkingMode::kChat);
  std::string content;
  std::vector<size_t> calls_seen_at;
  for (size_t i = 0; i < text.size(); ++i) {
    const auto d = p.feed(text.substr(i, 1));
    content += d.content;
    if (!d.tool_calls.empty()) calls_seen_at.push_back(i);
  }
  p.finish();
  EXPECT_EQ(content, "Let me check.");
  ASSERT_EQ(p.result().tool_calls.size(), 2u);
  EXPECT_EQ(p.result().tool_calls[0], (ToolCall{"a", "{\"k\": \"v\"}"}));
  EXPECT_EQ(p.result().tool_calls[1], (ToolCall{"b", "{}"}));
  ASSERT_EQ(calls_seen_at.size(), 2u);
  // Each call is returned when its </｜DSML｜invoke is read, before the block ends.
  EXPECT_EQ(calls_seen_at[0],
            text.find("</｜DSML｜invoke>") + std::string("</｜DSML｜invoke").size() - 1);
  EXPECT_LT(calls_seen_at[1], text.find("</｜DSML｜tool_calls>"));
}

TEST(Parse, TruncatedCompletionsReturnWhatWasHeldBack) {
  StreamingCompletionParser content(ThinkingMode::kChat);
  EXPECT_EQ(content.feed("answer\n\n<｜DS").content, "answer");
  EXPECT_EQ(content.finish_truncated().content, "\n\n<｜DS");  // a partial tag is text
  EXPECT_TRUE(content.ended());

  StreamingCompletionParser reasoning(ThinkingMode::kThinking);
  EXPECT_EQ(reasoning.feed("thinking </thi").reasoning, "thinking ");
  const auto r = reasoning.finish_truncated();
  EXPECT_EQ(r.reasoning, "</thi");
  EXPECT_EQ(r.content, "");

  // In a tool-call block only complete calls count; the unfinished one is never content.
  StreamingCompletionParser calls(ThinkingMode::kChat);
  const auto d = calls.feed(
      "c\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"a\">\n</｜DSML｜invoke>\n"
      "<｜DSML｜invoke name=\"b\">\n<｜DSML｜parameter name=\"k\" string=\"true\">v");
  EXPECT_EQ(d.content, "c");
  ASSERT_EQ(d.tool_calls.size(), 1u);
  const auto t = calls.finish_truncated();
  EXPECT_TRUE(t.empty());
  EXPECT_EQ(calls.result().tool_calls.size(), 1u);
}

TEST(Parse, AbandonReturnsTheUnreadTextAsWritten) {
  StreamingCompletionParser p(ThinkingMode::kChat);
  EXPECT_EQ(p.feed("a ").content, "a ");
  EXPECT_THROW(p.feed("b <think> c"), Error);
  EXPECT_EQ(p.result().content, "a b ");  // returned before the tag, in the feed that threw
  EXPECT_EQ(p.abandon(), "<think> c");
  EXPECT_TRUE(p.ended());

  StreamingCompletionParser block(ThinkingMode::kChat);
  const std::string bad =
      "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke nam=\"f\">\n</｜DSML｜invoke>\n";
  EXPECT_THROW(block.feed(bad), Error);
  EXPECT_EQ(block.abandon(), bad);
}

TEST(Parse, MalformedCompletionsFailInBothParsers) {
  const std::vector<std::pair<const char*, ThinkingMode>> bad = {
      {"no end of sentence", ThinkingMode::kChat},
      {"x<｜end▁of▁sentence｜>trailing", ThinkingMode::kChat},
      {"reasoning never closed<｜end▁of▁sentence｜>", ThinkingMode::kThinking},
      {"r\n\n<｜DSML｜tool_calls>\n</｜DSML｜tool_calls></think>", ThinkingMode::kThinking},
      {"a ｜DSML｜ b<｜end▁of▁sentence｜>", ThinkingMode::kChat},
      {"a <think> b<｜end▁of▁sentence｜>", ThinkingMode::kChat},
      {"r</think>a</think>b<｜end▁of▁sentence｜>", ThinkingMode::kThinking},
      {"\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n"
       "<｜DSML｜parameter name=\"k\" string=\"true\">1</｜DSML｜parameter>\n"
       "<｜DSML｜parameter name=\"k\" string=\"true\">2</｜DSML｜parameter>\n"
       "</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>",
       ThinkingMode::kChat},  // duplicate parameter
      {"\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke nam=\"f\">\n</｜DSML｜invoke>\n"
       "</｜DSML｜tool_calls><｜end▁of▁sentence｜>",
       ThinkingMode::kChat},
      {"\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n"
       "<｜DSML｜parameter name=\"k\" string=\"maybe\">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
       "</｜DSML｜tool_calls><｜end▁of▁sentence｜>",
       ThinkingMode::kChat},
      {"\n\n<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>x<｜end▁of▁sentence｜>",
       ThinkingMode::kChat},
      {"\n\n<｜DSML｜tool_calls>\n</｜DSML｜tool_calls><｜end▁of▁sent", ThinkingMode::kChat},
  };
  for (const auto& [text, mode] : bad) {
    EXPECT_THROW(parse_completion(text, mode), Error) << text;
    EXPECT_THROW(stream_parse(text, mode), Error) << text;
    EXPECT_THROW(stream_parse(text, mode, /*whole=*/true), Error) << text;
  }
}

TEST(Parse, AcceptsWhatTheOfficialParserAccepts) {
  // Its quirks, kept: EOS may be missing after a closed tool-call block, and the block may stop
  // right after an invoke's closing tag.
  const std::string closed =
      "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n\n</｜DSML｜invoke>\n"
      "</｜DSML｜tool_calls>";
  const std::string cut =
      "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n\n</｜DSML｜invoke";
  for (const std::string& text : {closed, cut}) {
    const ParsedCompletion batch = parse_both_ways(text, ThinkingMode::kChat);
    ASSERT_EQ(batch.tool_calls.size(), 1u) << text;
    EXPECT_EQ(batch.tool_calls[0], (ToolCall{"f", "{}"}));
  }
}

}  // namespace
}  // namespace dsv4::tok::test
