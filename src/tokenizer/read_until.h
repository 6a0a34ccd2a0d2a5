// The official DeepSeek-V4 parser's basic step, shared by the completion and DSML readers: read
// from a position up to the earliest of several stop strings.
#pragma once

#include <algorithm>
#include <initializer_list>
#include <string_view>

namespace dsv4::tok {

struct ReadResult {
  bool ready = false;  // false: not final and the outcome may still change
  size_t next = 0;     // just past the stop found (the end of the text if none)
  std::string_view content;
  int stop = -1;  // index of the stop found in the list, -1 for none
};

// Text from `from` to the earliest occurrence of any of `stops` (ties: the earlier in the list).
// With `final` false (text still arriving) the result is not ready while no stop is found, or
// while a stop that would start earlier may still be completing at the end of the text.
inline ReadResult read_until(std::string_view text, size_t from,
                             std::initializer_list<std::string_view> stops, bool final) {
  size_t best = std::string_view::npos, longest = 0;
  int which = -1, i = 0;
  for (std::string_view s : stops) {
    const size_t p = text.find(s, from);
    if (p != std::string_view::npos && p < best) {
      best = p;
      which = i;
    }
    longest = std::max(longest, s.size());
    ++i;
  }
  if (!final) {
    if (which < 0) return {};
    const size_t first = std::max(from, text.size() > longest ? text.size() - longest : 0);
    for (size_t q = first; q < best; ++q)
      for (std::string_view s : stops)
        if (text.size() - q < s.size() && s.substr(0, text.size() - q) == text.substr(q)) return {};
  }
  if (which < 0) return {true, text.size(), text.substr(from), -1};
  return {true, best + std::data(stops)[which].size(), text.substr(from, best - from), which};
}

}  // namespace dsv4::tok
