#include "common.h"

#include "core/error.h"

namespace dsv4::cli {

std::unique_ptr<Engine> open_engine(const Args& a, int64_t max_tokens) {
  EngineOptions o;
  o.model_dir = a.str("--model");
  o.backend = a.opt("--backend").value_or("cpu");
  const int64_t page = a.integer("--page-size", 64);
  DSV4_CHECK(page > 0 && page <= 4096, "--page-size must be in [1, 4096]");
  o.page_size = static_cast<int>(page);
  o.max_sequences = 1;
  o.max_tokens = std::max<int64_t>(max_tokens, 1);
  return Engine::open(o);
}

}  // namespace dsv4::cli
