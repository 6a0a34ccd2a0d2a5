#include "test_support.h"

#include <openssl/evp.h>

#include <nlohmann/json.hpp>

#include <sys/wait.h>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>

#include "core/error.h"
#include "tokenizer/byte_level.h"

namespace dsv4::tok::test {

std::string source_dir() {
  return DSV4_SOURCE_DIR;
}

std::string tokenizer_dir() {
  std::string dir;
  if (const char* env = std::getenv("DSV4_TOKENIZER_DIR"); env && *env)
    dir = env;
  else
    dir = source_dir() + "/../shared/tokenizer/deepseek-v4";
  return std::filesystem::exists(dir + "/tokenizer.json") ? dir : std::string();
}

const Tokenizer* shared_tokenizer() {
  static const std::unique_ptr<Tokenizer> tok = []() -> std::unique_ptr<Tokenizer> {
    const std::string dir = tokenizer_dir();
    if (dir.empty()) return nullptr;
    return std::make_unique<Tokenizer>(Tokenizer::from_file(dir + "/tokenizer.json"));
  }();
  return tok.get();
}

std::vector<std::string> added_token_strings(const Tokenizer& t) {
  std::vector<std::string> out;
  for (int32_t id : t.added_token_ids()) out.push_back(t.token_string(id));
  return out;
}

std::string read_file(const std::string& path) {
  std::ifstream is(path, std::ios::binary);
  DSV4_CHECK(is.good(), path, ": cannot open");
  std::ostringstream ss;
  ss << is.rdbuf();
  return ss.str();
}

void write_file(const std::string& path, const std::string& data) {
  std::ofstream os(path, std::ios::binary);
  os.write(data.data(), std::streamsize(data.size()));
  DSV4_CHECK(os.good(), path, ": cannot write");
}

std::string make_temp_dir() {
  std::string templ = (std::filesystem::temp_directory_path() / "dsv4-tok-XXXXXX").string();
  DSV4_CHECK(mkdtemp(templ.data()) != nullptr, "cannot create a temporary directory");
  return templ;
}

std::string sha256_hex(const void* data, size_t size) {
  std::array<unsigned char, EVP_MAX_MD_SIZE> md{};
  unsigned int len = 0;
  DSV4_CHECK(EVP_Digest(data, size, md.data(), &len, EVP_sha256(), nullptr) == 1, "SHA-256 failed");
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < len; ++i) {
    out += hex[md[i] >> 4];
    out += hex[md[i] & 15];
  }
  return out;
}

std::string ids_sha256(const std::vector<int32_t>& ids) {
  std::string bytes;
  bytes.reserve(ids.size() * 4);
  for (int32_t id : ids)
    for (int k = 0; k < 4; ++k) bytes += char((uint32_t(id) >> (8 * k)) & 0xFF);
  return sha256_hex(bytes.data(), bytes.size());
}

int run_command(const std::string& command, std::string* output) {
  FILE* p = popen(command.c_str(), "r");
  DSV4_CHECK(p != nullptr, "cannot run: ", command);
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  const int status = pclose(p);
  if (output) *output = out;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// 256 byte tokens (id = byte), then "ab" 256, "bc" 257, "abc" 258, "Ġa" 259, "Ġab" 260,
// "aa" 261; merges by rank: b+c, a+b, a+bc, Ġ+a, Ġa+b, a+a. Added tokens 262.. (HF numbers
// added tokens on from the vocabulary): "xy" (special, matched first on the raw text), "wxy",
// "<t>", "<t>>" (matched in what is left), then DeepSeek-V4's BOS, EOS, <｜User｜>,
// <｜Assistant｜>, <think>, </think> as 266..271 (so that chat prompts tokenize with small ids).
std::string tiny_tokenizer_json() {
  using nlohmann::json;
  const ByteLevelAlphabet alphabet;
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[alphabet.char_of(uint8_t(b))] = b;
  int id = 256;
  for (const char* t : {"ab", "bc", "abc", "\u0120a", "\u0120ab", "aa"}) vocab[t] = id++;
  auto added = [](int i, const char* content, bool special, bool normalized) {
    return json{{"id", i},           {"content", content}, {"single_word", false},
                {"lstrip", false},   {"rstrip", false},    {"normalized", normalized},
                {"special", special}};
  };
  json j = {{"version", "1.0"},
            {"added_tokens",
             {added(262, "xy", true, false), added(263, "wxy", false, true),
              added(264, "<t>", false, true), added(265, "<t>>", false, true),
              added(266, "<｜begin▁of▁sentence｜>", true, false),
              added(267, "<｜end▁of▁sentence｜>", true, false),
              added(268, "<｜User｜>", false, true), added(269, "<｜Assistant｜>", false, true),
              added(270, "<think>", false, true), added(271, "</think>", false, true)}},
            {"normalizer", {{"type", "Sequence"}, {"normalizers", json::array()}}},
            {"pre_tokenizer",
             {{"type", "Sequence"},
              {"pretokenizers",
               {{{"type", "Split"},
                 {"pattern", {{"Regex", "\\p{N}{1,3}"}}},
                 {"behavior", "Isolated"},
                 {"invert", false}},
                {{"type", "Split"},
                 {"pattern", {{"Regex", " ?\\p{L}+|\\s+(?!\\S)|\\s+|[^\\s\\p{L}]+"}}},
                 {"behavior", "Isolated"},
                 {"invert", false}},
                {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}}},
            {"post_processor", nullptr},
            {"decoder", {{"type", "ByteLevel"}}},
            {"model",
             {{"type", "BPE"},
              {"dropout", nullptr},
              {"unk_token", nullptr},
              {"byte_fallback", false},
              {"vocab", vocab},
              {"merges", {"b c", "a b", "a bc", "\u0120 a", "\u0120a b", "a a"}}}}};
  return j.dump();
}

std::string python_oracle_missing() {
  std::string out;
  const int rc =
      run_command("python3 -c 'import tokenizers; print(tokenizers.__version__)' 2>&1", &out);
  if (rc == 0) return "";
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  const size_t nl = out.rfind('\n');
  return "python3 cannot import the HF tokenizers package (" +
         (nl == std::string::npos ? out : out.substr(nl + 1)) +
         "); install it with: python3 -m pip install tokenizers";
}

}  // namespace dsv4::tok::test
