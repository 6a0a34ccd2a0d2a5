#include "common.h"

#include "core/error.h"
#if defined(DSV4_WITH_CUDA)
#include "backends/cuda/backend.h"
#endif

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
  o.verify = a.has("--verify");
  o.cuda_graphs = !a.has("--no-cuda-graphs");
  o.exact_linears = a.has("--exact-linears");
  o.dp = int(a.integer("--dp", 1));
  o.ep = int(a.integer("--ep", 1));
  o.tp = int(a.integer("--tp", 1));
  DSV4_CHECK(o.dp >= 1 && o.dp <= 1024 && o.ep >= 1 && o.ep <= 1024 && o.tp >= 1 && o.tp <= 1024,
             "--dp, --ep and --tp must be in [1, 1024]");
  const int64_t cache_mb = a.integer("--cache-mb", 0);
  DSV4_CHECK(cache_mb >= 0 && cache_mb <= (int64_t(1) << 30), "--cache-mb must be >= 0");
  o.cache_bytes = cache_mb << 20;
  if (o.backend != "cuda")
    DSV4_CHECK(
        !o.verify && cache_mb == 0 && o.cuda_graphs && !o.exact_linears,
        "--verify, --cache-mb, --no-cuda-graphs and --exact-linears apply to --backend cuda");
#if defined(DSV4_WITH_CUDA)
  register_cuda_backend();
#endif
  return Engine::open(o);
}

}  // namespace dsv4::cli
