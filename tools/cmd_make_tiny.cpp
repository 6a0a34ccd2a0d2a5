// dsv4 make-tiny --preset flash|pro --format mxfp4|nvfp4 --seed S --out DIR
#include <cstdio>

#include "args.h"
#include "commands.h"
#include "core/error.h"
#include "model/tiny_checkpoint.h"

namespace dsv4::cli {

int cmd_make_tiny(const Argv& argv) {
  Args a(argv, {"--preset", "--format", "--seed", "--out"}, {});
  const ModelConfig c = tiny_preset(a.str("--preset"));
  const std::string fmt = a.opt("--format").value_or("mxfp4");
  DSV4_CHECK(fmt == "mxfp4" || fmt == "nvfp4", "unknown --format '", fmt, "' (mxfp4, nvfp4)");
  const uint64_t seed = a.unsigned_integer("--seed", 0);
  const std::string out = a.str("--out");
  write_tiny_checkpoint(c, fmt == "nvfp4" ? ExpertFormat::kNvfp4 : ExpertFormat::kMxfp4, seed, out,
                        tiny_init(a.str("--preset")));
  std::printf("wrote %s (%s, %s, seed %llu)\n", out.c_str(), a.str("--preset").c_str(), fmt.c_str(),
              static_cast<unsigned long long>(seed));
  return 0;
}

}  // namespace dsv4::cli
