#include "model/backend_registry.h"

#include <map>
#include <mutex>

#include "core/error.h"

namespace dsv4 {
namespace {

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}

std::map<std::string, RunnerFactory>& registry() {
  static std::map<std::string, RunnerFactory> r;
  return r;
}

}  // namespace

void register_backend(const std::string& name, RunnerFactory factory) {
  DSV4_CHECK(!name.empty() && factory != nullptr, "cannot register backend '", name, "'");
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry()[name] = factory;
}

RunnerFactory find_backend(const std::string& name) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(name);
  return it == registry().end() ? nullptr : it->second;
}

std::vector<std::string> backend_names() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  std::vector<std::string> n;
  for (const auto& [k, v] : registry()) n.push_back(k);
  return n;
}

}  // namespace dsv4
