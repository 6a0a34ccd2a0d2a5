// Fuzzes the tokenizer on arbitrary bytes (what a server receives): encode never fails, every
// id is in the vocabulary, and decoding the ids gives back the text made valid UTF-8 (the
// documented round trip). With the first byte 0xff the rest is read as ids to decode, which
// must either decode or be refused with a dsv4::Error. Uses the DeepSeek-V4 tokenizer from
// $DSV4_TOKENIZER_DIR or ../shared/tokenizer/deepseek-v4 when present, else the tokenizer
// tests' tiny byte-level BPE tokenizer.json (tests/tokenizer/test_support).
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "test_support.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace {

std::unique_ptr<dsv4::tok::Tokenizer> tokenizer;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  std::string dir = std::getenv("DSV4_TOKENIZER_DIR") ? std::getenv("DSV4_TOKENIZER_DIR") : "";
  if (dir.empty()) dir = std::string(DSV4_SOURCE_DIR) + "/../shared/tokenizer/deepseek-v4";
  const std::string file = dir + "/tokenizer.json";
  tokenizer = std::make_unique<dsv4::tok::Tokenizer>(
      std::filesystem::exists(file)
          ? dsv4::tok::Tokenizer::from_file(file)
          : dsv4::tok::Tokenizer::from_json(dsv4::tok::test::tiny_tokenizer_json()));
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const dsv4::tok::Tokenizer& t = *tokenizer;
  if (size > 0 && data[0] == 0xff) {
    std::vector<int32_t> ids((size - 1) / 4);
    if (!ids.empty()) std::memcpy(ids.data(), data + 1, ids.size() * 4);
    try {
      const std::string text = t.decode(ids);
      if (!dsv4::tok::is_valid_utf8(text)) std::abort();
    } catch (const dsv4::Error&) {
    }
    return 0;
  }
  const std::string text(reinterpret_cast<const char*>(data), size);
  const std::vector<int32_t> ids = t.encode(text);
  for (int32_t id : ids)
    if (id < 0 || id >= t.size()) std::abort();
  if (t.decode(ids) != dsv4::tok::to_valid_utf8(text)) std::abort();
  return 0;
}
