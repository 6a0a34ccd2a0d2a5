#include "io/json_keys.h"

#include <set>
#include <vector>

namespace dsv4 {

nlohmann::json parse_json_noting_duplicates(std::string_view text, DuplicateKey* duplicate) {
  using json = nlohmann::json;
  *duplicate = {};
  std::vector<std::set<std::string>> open;  // the keys seen so far in each open object
  auto note = [&](int depth, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
        open.emplace_back();
        break;
      case json::parse_event_t::object_end:
        if (!open.empty()) open.pop_back();
        break;
      case json::parse_event_t::key:
        if (!open.empty() && !open.back().insert(parsed.get<std::string>()).second &&
            duplicate->key.empty())
          *duplicate = {parsed.get<std::string>(), depth};
        break;
      default:
        break;
    }
    return true;
  };
  return json::parse(text.begin(), text.end(), note);
}

}  // namespace dsv4
