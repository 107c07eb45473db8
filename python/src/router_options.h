// The MoE router's options as both Python bindings receive them (the numpy/DLPack module `_C` and
// the C++ torch library's sparsetrain::moe_route / _backward): the score by its name, as
// sparsetrain._moe.ROUTER_SCORES lists them.
#pragma once

#include <cstdint>
#include <string_view>

#include "sparsetrain/error.h"
#include "sparsetrain/moe_router.h"

namespace sparsetrain::wire {

inline RouterOptions router_options(int64_t num_experts, int64_t top_k, std::string_view score, bool normalize) {
  ST_CHECK_ARG(score == "softmax" || score == "sigmoid", "score", "softmax or sigmoid", score);
  return {num_experts, top_k, score == "softmax" ? RouterScore::kSoftmax : RouterScore::kSigmoid, normalize};
}

}  // namespace sparsetrain::wire
