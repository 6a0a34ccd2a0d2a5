// Incremental detokenization for streaming generation: each pushed id returns the text that is
// now final. Bytes that begin a UTF-8 character still missing its continuation bytes are held
// back until it completes, so no half character is ever emitted; the concatenation of all
// outputs (with finish()) equals Tokenizer::decode of all ids.
#pragma once

#include <cstdint>
#include <string>

#include "tokenizer/tokenizer.h"

namespace dsv4::tok {

class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer, bool skip_special = false)
      : tokenizer_(tokenizer), skip_special_(skip_special) {}

  // Text completed by `id` (often empty mid-character). Throws dsv4::Error for an unknown id.
  std::string push(int32_t id);
  // End of stream: whatever is held, an unfinished character becoming U+FFFD.
  std::string finish();
  // Bytes held back, waiting for the rest of a character.
  size_t pending() const { return pending_.size(); }

 private:
  const Tokenizer& tokenizer_;
  bool skip_special_;
  std::string pending_;
};

}  // namespace dsv4::tok
