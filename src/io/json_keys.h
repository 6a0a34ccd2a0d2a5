// JSON parsing that notices a key given twice in one object. nlohmann::json (like Python's
// json) silently keeps the last of duplicate keys; in a checkpoint header or a config that
// would hide a second tensor or value, so the readers report it instead.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace dsv4 {

struct DuplicateKey {
  std::string key;  // "" when every object's keys are distinct
  int depth = 0;    // 1: a key of the top-level object
};

// Parses `text` as nlohmann::json::parse does (throwing its parse_error on invalid JSON) and
// records the first key that appears twice in the same object in `*duplicate`.
nlohmann::json parse_json_noting_duplicates(std::string_view text, DuplicateKey* duplicate);

}  // namespace dsv4
