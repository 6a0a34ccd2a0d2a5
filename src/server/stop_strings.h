// Stop strings over streamed text: text is released as soon as it cannot be the start of a
// stop string; at the first match the text before it is released and the rest (the stop string
// included) never is. Stop strings are valid UTF-8, so a cut falls between characters.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace dsv4::server {

class StopStringMatcher {
 public:
  explicit StopStringMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}

  // Appends `text`; returns what is now final. Once matched(), returns nothing more.
  std::string push(std::string_view text);
  // End of the output: the held-back tail (empty after a match).
  std::string flush();
  bool matched() const { return matched_; }

 private:
  std::vector<std::string> stops_;
  std::string pending_;  // a tail that may still become a stop string
  bool matched_ = false;
};

}  // namespace dsv4::server
