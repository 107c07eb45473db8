// The router's argument checks for a caller that must run them before writing anything of its
// own (MoELayer::backward checks route_backward's inputs before the experts' backward queues a
// delayed wgrad).
#pragma once

#include "sparsetrain/moe_router.h"

namespace sparsetrain::ops {

// route_backward's checks of the options, logits and dscore_sum (experts and dprobs are the
// caller's own).
void check_route_backward_inputs(const RouterOptions& options, const TensorView& logits,
                                 const TensorView& dscore_sum);

}  // namespace sparsetrain::ops
