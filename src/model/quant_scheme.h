// Which checkpoint format each routed-expert projection uses: DeepSeek's native MXFP4, or
// NVIDIA ModelOpt NVFP4, resolved per module from hf_quant_config.json / moe_quant_algo.
#pragma once

#include <map>
#include <string>

#include "model/model_config.h"
#include "ops/common/weight_refs.h"

namespace dsv4 {

class QuantScheme {
 public:
  // Reads <dir>/hf_quant_config.json when present. Only routed experts may be quantised
  // differently from the release formats; anything else listed is an error.
  static QuantScheme load(const std::string& model_dir, const ModelConfig& config);
  // No hf_quant_config.json: the config's moe_quant_algo decides every routed expert.
  static QuantScheme of_config(const ModelConfig& config);

  // `module` like "layers.3.ffn.experts.7.w2" or "mtp.0.ffn.experts.1.w1".
  ExpertFormat expert_format(const std::string& module) const;
  bool has_modelopt_file() const { return has_file_; }

 private:
  bool default_nvfp4_ = false;
  bool has_file_ = false;
  std::map<std::string, ExpertFormat> per_module_;
};

}  // namespace dsv4
