// Next-token sampling from logits: temperature, top-k, inverse-CDF with a given uniform draw.
#pragma once
#include <cstdint>

namespace origami {

// Greedy (argmax, the lowest id of ties) when temperature == 0; top_k == 0 means all `vocab` tokens;
// u in [0, 1). A token whose logit is −inf or NaN is never drawn while any logit is finite.
int32_t sample_token(const float* logits, int32_t vocab, double temperature, int32_t top_k, double u);

}  // namespace origami
