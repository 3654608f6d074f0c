// LM head with fused softmax cross-entropy: logits = x·Wᵀ, loss_n = logsumexp(logits_n) − logits_n[target_n].
// Logits exist only for a chunk of rows at a time (never [N, V] for the whole batch, unless the
// caller asks for them through logits_NV). With dx_NC, the backward is fused in:
// dlogits = grad_scale·(softmax − onehot(target)), dx_NC = dlogits·W (overwritten), dW += dlogitsᵀ·x.
// Legend: N rows, C channels, V vocabulary. W is [V, C] (the tied embedding or lm_head.weight).
#pragma once
#include <cstdint>
#include <vector>

namespace origami {

// Returns Σ_n loss_n (in double).
template <typename T>
double lm_head_loss(T* dx_NC, T* dw_VC, T* logits_NV, const T* x_NC, const T* w_VC, const int32_t* targets_N,
                    int64_t N, int64_t C, int64_t V, T grad_scale, std::vector<T>& scratch);

}  // namespace origami
