// hf_quant_config.json (ModelOpt) -> QuantScheme.
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>

#include "core/error.h"
#include "core/excerpt.h"
#include "model/quant_scheme.h"

namespace dsv4 {

QuantScheme QuantScheme::load(const std::string& dir, const ModelConfig& config) {
  QuantScheme q;
  q.default_nvfp4_ = config.moe_quant_algo == "NVFP4";
  const auto path = std::filesystem::path(dir) / "hf_quant_config.json";
  if (!std::filesystem::exists(path)) return q;
  q.has_file_ = true;
  const std::string p = path.string();
  std::ifstream is(path);
  DSV4_CHECK(is.good(), p, ": cannot open");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(is);
  } catch (const nlohmann::json::exception& e) {
    throw Error(cat(p, ": not valid JSON: ", parser_message(e.what())));
  }
  DSV4_CHECK(j.is_object() && j.contains("quantization") && j["quantization"].is_object(), p,
             ": missing object 'quantization'");
  const auto& quant = j["quantization"];
  const std::regex expert_re(R"(^(mtp|layers)\.\d+\.ffn\.experts\.\d+\.w[123]$)");
  if (quant.contains("quantized_layers")) {
    DSV4_CHECK(quant["quantized_layers"].is_object(), p, ": 'quantized_layers' must be an object");
    for (auto it = quant["quantized_layers"].begin(); it != quant["quantized_layers"].end(); ++it) {
      const std::string& module = it.key();
      const auto& v = it.value();
      DSV4_CHECK(v.is_object() && v.contains("quant_algo") && v["quant_algo"].is_string(), p,
                 ": quantized_layers entry '", module, "' has no quant_algo");
      const std::string algo = v["quant_algo"].get<std::string>();
      DSV4_CHECK(std::regex_match(module, expert_re), p, ": module '", module, "' is quantised as ",
                 algo, "; only routed experts may use a ModelOpt format");
      DSV4_CHECK(algo == "NVFP4", p, ": module '", module, "' uses unsupported quant_algo '", algo,
                 "' (NVFP4 supported)");
      if (v.contains("group_size"))
        DSV4_CHECK(v["group_size"] == 16, p, ": module '", module, "' NVFP4 group_size must be 16");
      q.per_module_[module] = ExpertFormat::kNvfp4;
    }
  } else {
    DSV4_CHECK(quant.contains("quant_algo") && quant["quant_algo"].is_string(), p,
               ": neither 'quantized_layers' nor 'quant_algo'");
    const std::string algo = quant["quant_algo"].get<std::string>();
    DSV4_CHECK(algo == "NVFP4", p, ": unsupported quant_algo '", algo, "'");
    q.default_nvfp4_ = true;
  }
  return q;
}

QuantScheme QuantScheme::of_config(const ModelConfig& config) {
  QuantScheme q;
  q.default_nvfp4_ = config.moe_quant_algo == "NVFP4";
  return q;
}

ExpertFormat QuantScheme::expert_format(const std::string& module) const {
  auto it = per_module_.find(module);
  if (it != per_module_.end()) return it->second;
  // With a ModelOpt file listing modules, unlisted experts keep the release format.
  if (has_file_ && !per_module_.empty()) return ExpertFormat::kMxfp4;
  return default_nvfp4_ ? ExpertFormat::kNvfp4 : ExpertFormat::kMxfp4;
}

}  // namespace dsv4
