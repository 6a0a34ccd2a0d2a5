// Shared pieces of the tokenizer tests: where the shared tokenizer data lives, the tokenizer
// loaded once per test program, file and hashing helpers, and the Python oracle's availability.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace dsv4::tok::test {

// $DSV4_TOKENIZER_DIR, else <source>/../shared/tokenizer/deepseek-v4; empty when that folder
// has no tokenizer.json.
std::string tokenizer_dir();
// The DeepSeek-V4 tokenizer from tokenizer_dir(), loaded on first use; nullptr if absent.
const Tokenizer* shared_tokenizer();
// Contents of every added token of `t`, in id order.
std::vector<std::string> added_token_strings(const Tokenizer& t);

std::string read_file(const std::string& path);
void write_file(const std::string& path, const std::string& data);
// A fresh directory under the system temp folder.
std::string make_temp_dir();

std::string sha256_hex(const void* data, size_t size);
// SHA-256 of ids as consecutive little-endian uint32 (the stored expectations' form).
std::string ids_sha256(const std::vector<int32_t>& ids);

// Runs `command` through the shell; returns its exit status and fills `output` with stdout.
int run_command(const std::string& command, std::string* output = nullptr);
// "" if python3 can import the HF tokenizers package, else why not.
std::string python_oracle_missing();
std::string source_dir();

// A tiny byte-level BPE tokenizer.json written for the tests (see test_support.cpp): hand-picked
// merges whose outcome can be worked out by hand, a few added tokens, and the chat tokens.
std::string tiny_tokenizer_json();

}  // namespace dsv4::tok::test
