// The MoE router's score function (config.json `scoring_func`).
#pragma once

namespace dsv4 {

enum class ScoreFunc { kSqrtSoftplus, kSoftmax, kSigmoid };

}  // namespace dsv4
