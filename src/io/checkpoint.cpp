#include "io/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "core/excerpt.h"
#include "io/json_keys.h"

namespace fs = std::filesystem;

namespace dsv4 {

Checkpoint::Checkpoint(const std::string& dir) : dir_(dir) {
  DSV4_CHECK(fs::is_directory(dir), dir, ": model directory does not exist");
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(index_path)) {
    std::ifstream is(index_path);
    DSV4_CHECK(is.good(), index_path.string(), ": cannot open");
    const std::string text(std::istreambuf_iterator<char>(is), {});
    nlohmann::json index;
    DuplicateKey dup;
    try {
      index = parse_json_noting_duplicates(text, &dup);
    } catch (const nlohmann::json::exception& e) {
      throw Error(cat(index_path.string(), ": not valid JSON: ", parser_message(e.what())));
    }
    DSV4_CHECK(dup.key.empty(), index_path.string(), ": key ", excerpt(dup.key),
               " appears twice in one object");
    DSV4_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
               index_path.string(), ": missing object 'weight_map'");
    std::map<std::string, std::vector<std::string>> by_file;
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
      DSV4_CHECK(it.value().is_string(), index_path.string(), ": weight_map entry ",
                 excerpt(it.key(), 120), " is not a file name");
      const std::string file = it.value().get<std::string>();
      DSV4_CHECK(file.find('/') == std::string::npos && file.find("..") == std::string::npos,
                 index_path.string(), ": shard name ", excerpt(file, 120),
                 " must be a plain file name");
      by_file[file].push_back(it.key());
    }
    DSV4_CHECK(!by_file.empty(), index_path.string(), ": weight_map is empty");
    for (const auto& [file, names] : by_file)
      DSV4_CHECK(fs::exists(fs::path(dir) / file), index_path.string(), ": shard '", file,
                 "' (holding '", names.front(), "' and ", names.size() - 1,
                 " more) does not exist");
    for (const auto& [file, names] : by_file) {
      const fs::path p = fs::path(dir) / file;
      files_.push_back(std::make_unique<SafetensorsFile>(p.string()));
      const SafetensorsFile& f = *files_.back();
      std::set<std::string> listed(names.begin(), names.end());
      for (const auto& n : names) {
        DSV4_CHECK(f.contains(n), p.string(), ": the index assigns tensor '", n,
                   "' to this shard but it is not there");
        where_[n] = &f.get(n);
      }
      for (const auto& [n, t] : f.tensors()) {
        if (listed.count(n)) continue;
        const auto& map = index["weight_map"];
        DSV4_CHECK(!map.contains(n), p.string(), ": tensor ", excerpt(n, 120),
                   " is also in shard '", map[n].get<std::string>(),
                   "', to which the index assigns it (duplicate tensor name)");
        throw Error(cat(p.string(), ": tensor ", excerpt(n, 120),
                        " is in the shard but not in model.safetensors.index.json"));
      }
    }
    return;
  }
  fs::path single = fs::path(dir) / "model.safetensors";
  if (!fs::exists(single)) {
    std::vector<fs::path> found;
    for (const auto& e : fs::directory_iterator(dir))
      if (e.is_regular_file() && e.path().extension() == ".safetensors") found.push_back(e.path());
    DSV4_CHECK(!found.empty(), dir, ": no model.safetensors.index.json and no *.safetensors file");
    DSV4_CHECK(found.size() == 1, dir, ": ", found.size(),
               " *.safetensors files but no model.safetensors.index.json to say how they fit");
    single = found.front();
  }
  files_.push_back(std::make_unique<SafetensorsFile>(single.string()));
  for (const auto& [n, t] : files_.back()->tensors()) where_[n] = &t;
}

Checkpoint::Checkpoint(const std::string& name, std::shared_ptr<const TensorStore> store)
    : dir_(name), store_(std::move(store)) {
  DSV4_CHECK(store_ != nullptr, name, ": no tensor store");
  for (const auto& [n, t] : store_->tensors()) where_[n] = &t;
}

const TensorView& Checkpoint::get(const std::string& name) const {
  auto it = where_.find(name);
  DSV4_CHECK(it != where_.end(), dir_, ": checkpoint has no tensor '", name, "'");
  return *it->second;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> v;
  v.reserve(where_.size());
  for (const auto& [n, t] : where_) v.push_back(n);
  return v;
}

}  // namespace dsv4
