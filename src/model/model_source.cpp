#include "model/model_source.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/formats.h"
#include "model/tiny_checkpoint.h"
#include "model/weights.h"

namespace fs = std::filesystem;

namespace dsv4 {
namespace {

bool is_tiny_preset(const std::string& p) {
  return p == "flash" || p == "pro";
}

// The geometry make-tiny would write with these options.
ModelConfig random_config(const RandomWeights& r) {
  ModelConfig c;
  if (is_tiny_preset(r.preset)) {
    c = tiny_preset(r.preset);
  } else {
    DSV4_CHECK(fs::is_regular_file(r.preset), "random weights: '", r.preset,
               "' is neither a preset (flash, pro) nor a config.json file");
    c = load_model_config(r.preset);
  }
  if (r.layers > 0) c = first_layers(c, r.layers);
  if (r.vocab > 0) {
    DSV4_CHECK(r.vocab >= 2 && r.vocab <= (int64_t(1) << 24),
               "random weights: vocab must be in [2, 2^24], got ", r.vocab);
    c.vocab_size = static_cast<int>(r.vocab);
  }
  c.moe_quant_algo = r.format == ExpertFormat::kNvfp4 ? "NVFP4" : "";
  c.validate();
  return c;
}

TinyInit random_init(const RandomWeights& r) {
  // A config.json's geometry takes the flash preset's gains (as make-tiny --config).
  TinyInit init = tiny_init(is_tiny_preset(r.preset) ? r.preset : "flash");
  init.repeat_experts = r.repeat_experts;
  return init;
}

std::string read_text(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  DSV4_CHECK(f.good(), p.string(), ": cannot open");
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

}  // namespace

std::string RandomWeights::describe() const {
  std::string s = cat("random weights (", preset, ", ",
                      format == ExpertFormat::kNvfp4 ? "nvfp4" : "mxfp4", ", seed ", seed);
  if (layers > 0) s += cat(", ", layers, layers == 1 ? " layer" : " layers");
  if (vocab > 0) s += cat(", vocab ", vocab);
  if (repeat_experts) s += ", repeated experts";
  return s + ")";
}

void ModelSource::check() const {
  DSV4_CHECK(!(random.enabled() && !model_dir.empty()), "give either a model directory (",
             model_dir, ") or random weights (", random.preset, "), not both");
  DSV4_CHECK(random.enabled() || !model_dir.empty(),
             "no model: give a model directory or random weights");
  if (!random.enabled())
    DSV4_CHECK(fs::is_directory(model_dir), model_dir, ": model directory does not exist");
}

ModelHeader open_model_header(const ModelSource& source) {
  source.check();
  ModelHeader h;
  if (source.random.enabled()) {
    // As loading the config.json make-tiny writes (the same numbers, bit for bit).
    h.config = parse_model_config(model_config_to_json(random_config(source.random)),
                                  source.random.describe());
    h.scheme = QuantScheme::of_config(h.config);
    return h;
  }
  h.config = load_model_config((fs::path(source.model_dir) / "config.json").string());
  h.scheme = QuantScheme::load(source.model_dir, h.config);
  return h;
}

std::unique_ptr<Checkpoint> open_model_checkpoint(const ModelSource& source) {
  source.check();
  if (!source.random.enabled()) return std::make_unique<Checkpoint>(source.model_dir);
  const RandomWeights& r = source.random;
  TinyModel m = make_tiny_model(random_config(r), r.format, r.seed, random_init(r));
  return std::make_unique<Checkpoint>(r.describe(), std::move(m.tensors));
}

int64_t random_weights_bytes(const RandomWeights& r) {
  DSV4_CHECK(r.enabled(), "random_weights_bytes: no random weights");
  const ModelConfig c = random_config(r);
  int64_t bytes = 0;
  for (const ExpectedTensor& t : weight_inventory(c, QuantScheme::of_config(c))) {
    // "....ffn.experts.E.": with repeat_experts, E > 0 views expert 0's bytes.
    const size_t at = t.name.find(".ffn.experts.");
    if (r.repeat_experts && at != std::string::npos && t.name.compare(at + 13, 2, "0.") != 0)
      continue;
    int64_t n = int64_t(dtype_size(t.dtype));
    for (int64_t d : t.shape) n *= d;
    bytes += n;
  }
  return bytes;
}

std::string model_identity(const ModelSource& source) {
  source.check();
  if (!source.random.enabled()) return read_text(fs::path(source.model_dir) / "config.json");
  return source.random.describe() + "\n" + model_config_to_json(random_config(source.random));
}

}  // namespace dsv4
