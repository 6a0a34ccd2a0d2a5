#include "common.h"

#include "core/error.h"

namespace dsv4::cli {

void check_backend(const Args& a) {
  const std::string b = a.opt("--backend").value_or("cpu");
  if (b == "cpu") return;
  if (b == "cuda") throw Error("--backend cuda is not available yet: the CUDA engine is not built "
                               "(run with --backend cpu)");
  throw Error(cat("unknown backend '", b, "' (cpu)"));
}

LoadedModel open_model(const Args& a) { return load_cpu_model(a.str("--model")); }

}  // namespace dsv4::cli
