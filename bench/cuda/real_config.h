// The real V4-Flash / V4-Pro geometry for the benchmarks: tests/data/deepseek-v4-{flash,pro}.
// config.json, the files the CLI's --random-weights, the memory-plan tests and run.sh
// verify-real read, so every benchmark measures the geometry those files define (they were
// copied by hand into each benchmark before). Host code only.
#pragma once

#include <string>

#include "model/model_config.h"

namespace dsv4::bench {

// model: "flash" or "pro"; nvfp4: the routed experts' format (moe_quant_algo), MXFP4 otherwise.
inline ModelConfig real_config(const std::string& model, bool nvfp4) {
  ModelConfig c = load_model_config(std::string(DSV4_SOURCE_DIR) + "/tests/data/deepseek-v4-" +
                                    model + ".config.json");
  c.moe_quant_algo = nvfp4 ? "NVFP4" : "";
  return c;
}

}  // namespace dsv4::bench
