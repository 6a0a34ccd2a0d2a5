// Fuzzes config.json parsing and the memory plan over what it accepts. An accepted config
// must validate, survive its own JSON round trip unchanged, and plan without overflow (UBSan
// checks the arithmetic); everything else must be a dsv4::Error.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "core/error.h"
#include "model/memory_plan.h"
#include "model/model_config.h"
#include "model/quant_scheme.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  dsv4::ModelConfig c;
  try {
    c = dsv4::parse_model_config(text, "config.json");
  } catch (const dsv4::Error&) {
    return 0;
  }
  c.validate();  // throws (and so aborts the fuzzer) if the parser let something through
  const dsv4::ModelConfig back =
      dsv4::parse_model_config(dsv4::model_config_to_json(c), "round trip");
  if (back.compress_ratios != c.compress_ratios || back.window_size != c.window_size ||
      back.norm_eps != c.norm_eps || back.rope_factor != c.rope_factor ||
      back.hc_sinkhorn_iters != c.hc_sinkhorn_iters)
    std::abort();
  // The plan walks every tensor of the inventory: keep that walk small.
  if (int64_t(c.num_blocks()) * c.n_routed_experts > 4096) return 0;
  for (const int64_t tokens : {int64_t(1), int64_t(4096), int64_t(1) << 30})
    for (const dsv4::PlanBackend b : {dsv4::PlanBackend::kCpu, dsv4::PlanBackend::kCuda}) {
      dsv4::MemoryPlanOptions o;
      o.backend = b;
      o.max_tokens = tokens;
      o.max_sequences = 64;
      try {
        const dsv4::MemoryPlan p =
            dsv4::plan_memory(c, dsv4::QuantScheme::load("/nonexistent", c), o);
        for (const dsv4::MemoryPool& m : p.pools)
          if (m.weights < 0 || m.cache < 0 || m.activations < 0 || m.required() < 0) std::abort();
      } catch (const dsv4::Error&) {
      }
    }
  return 0;
}
