// Rotary position embedding (Hugging Face llama convention, "rotate_half"): within each head's
// D values, element i pairs with i + D/2 and is rotated by angle pos·θ^(−2i/D).
// Applied in place to the q and k heads of a packed qkv row [q(H·D) | k(KV·D) | v(KV·D)];
// backward rotates the gradient by the opposite angle, in place.
// Legend: B batch, T positions, H query heads, KV key/value heads, D head dim. pos[B, T], when given,
// is each token's position id (context parallelism holds non-contiguous chunks; document masking
// restarts positions at every document); else t.
#pragma once
#include <cstdint>
#include <vector>

namespace origami {

// cos/sin tables [T, D/2], computed in double.
struct RopeTable {
  int64_t max_T = 0, half = 0;
  std::vector<double> cos, sin;
  RopeTable() = default;
  RopeTable(int64_t max_T, int64_t head_dim, double theta);
};

template <typename T>
void rope_forward(T* qkv, const RopeTable& rt, int64_t B, int64_t Tn, int64_t H, int64_t KV, int64_t D,
                  const int64_t* pos = nullptr);
template <typename T>
void rope_backward(T* dqkv, const RopeTable& rt, int64_t B, int64_t Tn, int64_t H, int64_t KV, int64_t D,
                   const int64_t* pos = nullptr);

}  // namespace origami
