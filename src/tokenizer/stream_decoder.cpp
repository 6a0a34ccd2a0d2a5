#include "tokenizer/stream_decoder.h"

#include "tokenizer/utf8.h"

namespace dsv4::tok {

std::string StreamDecoder::push(int32_t id) {
  const std::string& bytes = tokenizer_.token_bytes(id);
  if (skip_special_ && tokenizer_.is_special(id)) return {};
  pending_ += bytes;
  // Everything before a cut-short character is final: an ill-formed part there can no longer
  // become well-formed, so it is replaced now exactly as a whole-text decode would.
  const size_t keep = incomplete_utf8_tail(pending_);
  std::string out = to_valid_utf8(std::string_view(pending_).substr(0, pending_.size() - keep));
  pending_.erase(0, pending_.size() - keep);
  return out;
}

std::string StreamDecoder::finish() {
  std::string out = to_valid_utf8(pending_);
  pending_.clear();
  return out;
}

}  // namespace dsv4::tok
