#include "backends/cpu/loader.h"

#include "backends/cpu/weights.h"
#include "core/error.h"
#include "io/checkpoint.h"
#include "model/weight_scan.h"
#include "model/weights.h"

namespace dsv4 {

LoadedModel load_cpu_model(const std::string& dir) {
  ModelSource source;
  source.model_dir = dir;
  return load_cpu_model(source);
}

LoadedModel load_cpu_model(const ModelSource& source) {
  LoadedModel m;
  ModelHeader header = open_model_header(source);
  m.config = std::move(header.config);
  m.scheme = std::move(header.scheme);
  const std::unique_ptr<Checkpoint> ckpt = open_model_checkpoint(source);
  const WeightsRef ref = bind_weights(*ckpt, m.config, m.scheme);
  check_weights_finite(*ckpt);
  m.model = std::make_unique<CpuModel>(m.config, cpu::prepare_weights(m.config, ref));
  return m;
}

}  // namespace dsv4
