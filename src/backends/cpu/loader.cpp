#include "backends/cpu/loader.h"

#include <filesystem>

#include "backends/cpu/weights.h"
#include "core/error.h"
#include "io/checkpoint.h"
#include "model/weight_scan.h"
#include "model/weights.h"

namespace dsv4 {

LoadedModel load_cpu_model(const std::string& dir) {
  DSV4_CHECK(std::filesystem::is_directory(dir), dir, ": model directory does not exist");
  LoadedModel m;
  m.config = load_model_config((std::filesystem::path(dir) / "config.json").string());
  m.scheme = QuantScheme::load(dir, m.config);
  Checkpoint ckpt(dir);
  const WeightsRef ref = bind_weights(ckpt, m.config, m.scheme);
  check_weights_finite(ckpt);
  m.model = std::make_unique<CpuModel>(m.config, cpu::prepare_weights(m.config, ref));
  return m;
}

}  // namespace dsv4
