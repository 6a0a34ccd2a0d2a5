// Literal matching of added tokens (<｜User｜>, <think>, ...) in raw text before BPE, with the
// leftmost-longest rule HF tokenizers uses: the earliest match wins, the longest at that place.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dsv4::tok {

class AddedTokenMatcher {
 public:
  struct Match {
    size_t begin = 0, length = 0;
    int32_t id = -1;
  };

  void add(std::string_view content, int32_t id);  // content must be non-empty
  bool empty() const { return nodes_.size() <= 1; }

  // The leftmost-longest match in text[from..], or a match with id -1 if there is none.
  Match find(std::string_view text, size_t from) const;

 private:
  struct Node {
    std::vector<std::pair<uint8_t, int32_t>> children;  // (byte, node), unsorted, few
    int32_t id = -1;                                    // token ending here
  };
  int32_t child(int32_t node, uint8_t b) const;
  // Length and id of the longest token that starts at text[at].
  Match longest_at(std::string_view text, size_t at) const;

  std::vector<Node> nodes_ = std::vector<Node>(1);
  std::array<bool, 256> first_byte_{};
};

}  // namespace dsv4::tok
