// Fuzzes the server's request parsing (what an HTTP body reaches): the JSON body parser, then
// the chat or completions request parser (first byte even: chat, odd: completions) with the
// tokenizer rendering and tokenizing the prompt. A body is either a request or refused with an
// ApiError or dsv4::Error (a 4xx); any other exception would be a 500 and aborts. An accepted
// request has jobs whose prompts are non-empty and within the model's vocabulary and length.
// Tokenizer: the DeepSeek-V4 one from $DSV4_TOKENIZER_DIR or ../shared/tokenizer/deepseek-v4
// when present, else the tokenizer tests' tiny tokenizer.json.
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

#include "core/error.h"
#include "server/api_error.h"
#include "server/generation_request.h"
#include "server/json_fields.h"
#include "test_support.h"
#include "tokenizer/tokenizer.h"

namespace {

std::unique_ptr<dsv4::tok::Tokenizer> tokenizer;
dsv4::server::ParseContext context;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  std::string dir = std::getenv("DSV4_TOKENIZER_DIR") ? std::getenv("DSV4_TOKENIZER_DIR") : "";
  if (dir.empty()) dir = std::string(DSV4_SOURCE_DIR) + "/../shared/tokenizer/deepseek-v4";
  const std::string file = dir + "/tokenizer.json";
  tokenizer = std::make_unique<dsv4::tok::Tokenizer>(
      std::filesystem::exists(file)
          ? dsv4::tok::Tokenizer::from_file(file)
          : dsv4::tok::Tokenizer::from_json(dsv4::tok::test::tiny_tokenizer_json()));
  context.tokenizer = tokenizer.get();
  context.info.vocab_size = int(tokenizer->size());
  context.info.max_tokens = 4096;
  context.served_model_name = "tiny";
  context.forced_output_enabled = true;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool chat = (data[0] & 1) == 0;
  const std::string body(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    const dsv4::server::ordered_json j = dsv4::server::parse_json_body(body);
    const dsv4::server::GenerationRequest g =
        chat ? dsv4::server::parse_chat_request(j, context)
             : dsv4::server::parse_completion_request(j, context);
    if (g.jobs.empty()) std::abort();
    for (const dsv4::server::Job& job : g.jobs) {
      if (job.prompt.empty() || int64_t(job.prompt.size()) > context.info.max_tokens) std::abort();
      for (int32_t id : job.prompt)
        if (id < 0 || id >= context.info.vocab_size) std::abort();
    }
  } catch (const dsv4::server::ApiError&) {
  } catch (const dsv4::Error&) {
  }
  return 0;
}
