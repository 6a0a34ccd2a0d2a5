// Pieces shared by the model-running subcommands.
#pragma once

#include <string>

#include "args.h"
#include "runtime/model_loader.h"

namespace dsv4::cli {

// --backend: "cpu" runs; "cuda" is refused with the reason until the CUDA backend exists.
void check_backend(const Args& a);
// Opens --model DIR (required).
LoadedModel open_model(const Args& a);

}  // namespace dsv4::cli
