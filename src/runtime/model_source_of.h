// The model an engine's options name: a checkpoint directory or random weights made in memory
// (EngineOptions::model_dir / random_weights), converted and checked once for every caller (the
// engine, `dsv4 plan`).
#pragma once

#include "dsv4/engine.h"
#include "model/model_source.h"

namespace dsv4 {

// Throws dsv4::Error unless exactly one source is given and its options are valid.
ModelSource model_source(const EngineOptions& o);

}  // namespace dsv4
