#include "tokenizer/added_tokens.h"

#include "core/error.h"

namespace dsv4::tok {

int32_t AddedTokenMatcher::child(int32_t node, uint8_t b) const {
  for (const auto& [byte, next] : nodes_[size_t(node)].children)
    if (byte == b) return next;
  return -1;
}

void AddedTokenMatcher::add(std::string_view content, int32_t id) {
  DSV4_CHECK(!content.empty(), "added token ", id, " has empty content");
  int32_t node = 0;
  for (char c : content) {
    const auto b = static_cast<uint8_t>(c);
    int32_t next = child(node, b);
    if (next < 0) {
      next = int32_t(nodes_.size());
      nodes_[size_t(node)].children.emplace_back(b, next);
      nodes_.emplace_back();
    }
    node = next;
  }
  nodes_[size_t(node)].id = id;  // a repeated content keeps the last id, as a map would
  first_byte_[static_cast<uint8_t>(content[0])] = true;
}

AddedTokenMatcher::Match AddedTokenMatcher::longest_at(std::string_view text, size_t at) const {
  Match best;
  int32_t node = 0;
  for (size_t i = at; i < text.size(); ++i) {
    node = child(node, static_cast<uint8_t>(text[i]));
    if (node < 0) break;
    if (nodes_[size_t(node)].id >= 0) best = {at, i + 1 - at, nodes_[size_t(node)].id};
  }
  return best;
}

AddedTokenMatcher::Match AddedTokenMatcher::find(std::string_view text, size_t from) const {
  if (empty()) return {};
  for (size_t i = from; i < text.size(); ++i) {
    if (!first_byte_[static_cast<uint8_t>(text[i])]) continue;
    const Match m = longest_at(text, i);
    if (m.id >= 0) return m;
  }
  return {};
}

}  // namespace dsv4::tok
