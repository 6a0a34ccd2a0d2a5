#include "server/server_context.h"

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "server/json_fields.h"

namespace dsv4::server {
namespace {

// generation_config.json's temperature / top_p / top_k, the defaults of requests that leave
// them out (as vLLM does); OpenAI's defaults without one.
void read_generation_defaults(const std::string& model_dir, ParseContext& p) {
  const std::filesystem::path path = std::filesystem::path(model_dir) / "generation_config.json";
  if (!std::filesystem::exists(path)) return;
  std::ifstream is(path);
  ordered_json j;
  try {
    j = ordered_json::parse(is);
  } catch (const ordered_json::exception& e) {
    throw Error(cat(path.string(), ": invalid JSON: ", e.what()));
  }
  auto read = [&](const char* key, double& out, double lo, double hi) {
    if (!j.contains(key) || j[key].is_null()) return;
    DSV4_CHECK(j[key].is_number() && j[key].get<double>() >= lo && j[key].get<double>() <= hi,
               path.string(), ": ", key, " must be a number in [", lo, ", ", hi, "]");
    out = j[key].get<double>();
  };
  read("temperature", p.temperature, 0, 1e4);
  read("top_p", p.top_p, 1e-9, 1);
  double top_k = p.top_k;
  read("top_k", top_k, -1, 1e9);
  p.top_k = top_k < 0 ? 0 : int(top_k);
}

}  // namespace

ServerContext::ServerContext(ServerOptions o)
    : options(std::move(o)),
      model_name(!options.served_model_name.empty() ? options.served_model_name
                 : options.engine.model_dir.empty()
                     ? "random-weights:" + options.engine.random_weights.preset
                     : options.engine.model_dir) {
  worker = std::make_unique<EngineWorker>(
      options.engine, options.max_waiting, [this](const ModelInfo& info) {
        const std::string path = !options.tokenizer_path.empty()
                                     ? options.tokenizer_path
                                     : options.engine.model_dir + "/tokenizer.json";
        DSV4_CHECK(!options.engine.model_dir.empty() || !options.tokenizer_path.empty(),
                   "random weights have no tokenizer.json, which serving text needs (give one)");
        DSV4_CHECK(std::filesystem::exists(path), options.engine.model_dir,
                   " has no tokenizer.json, which serving text needs (dsv4 make-tiny --tokenizer "
                   "FILE writes one)");
        tokenizer = std::make_unique<tok::Tokenizer>(tok::Tokenizer::from_file(path));
        DSV4_CHECK(tokenizer->size() <= info.vocab_size, path, " has ", tokenizer->size(),
                   " ids, more than the model's vocabulary of ", info.vocab_size);
        parse.tokenizer = tokenizer.get();
        parse.info = info;
        parse.served_model_name = model_name;
        parse.forced_output_enabled = options.forced_output;
        if (!options.engine.model_dir.empty())
          read_generation_defaults(options.engine.model_dir, parse);
      });
}

}  // namespace dsv4::server
