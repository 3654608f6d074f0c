// What the fp32 (attention.cu) and bf16 (attention_bf16.cu) attention kernels share: where a token's
// heads are in the packed rows, which keys a query sees, and the backward's row term.
#pragma once
#include <cmath>
#include <cstdint>

#include "core/error.h"

namespace origami::cuda {

// Where a token's heads are in the packed rows (attention.h's legend).
struct Dims {
  int64_t T, H, KV, D, S, group;  // S = (H + 2·KV)·D; group = H / KV query heads per kv head
  const int32_t* doc;             // [B, T] or null
  float scale;                    // 1/√D
  __device__ int64_t q_at(int64_t b, int64_t t, int64_t h) const { return (b * T + t) * S + h * D; }
  __device__ int64_t k_at(int64_t b, int64_t t, int64_t g) const { return (b * T + t) * S + (H + g) * D; }
  __device__ int64_t v_at(int64_t b, int64_t t, int64_t g) const { return (b * T + t) * S + (H + KV + g) * D; }
  __device__ int64_t o_at(int64_t b, int64_t t, int64_t h) const { return (b * T + t) * H * D + h * D; }
  __device__ int64_t l_at(int64_t b, int64_t t, int64_t h) const { return (b * H + h) * T + t; }
  // Key j visible to query i (both < T).
  __device__ bool visible(int64_t b, int64_t i, int64_t j) const {
    return j <= i && (!doc || doc[b * T + j] == doc[b * T + i]);
  }
  // No pair of queries [i0, i1) and keys [j0, j1) visible (documents are nondecreasing along a row).
  __device__ bool empty(int64_t b, int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    return j0 >= i1 || i0 >= T || (doc && doc[b * T + j1 - 1] < doc[b * T + i0]);
  }
};

inline Dims dims(int64_t T, int64_t H, int64_t KV, int64_t D, const int32_t* doc) {
  if (KV <= 0 || H % KV != 0) throw Error(cat("CUDA attention: ", H, " query heads over ", KV, " kv heads"));
  return {T, H, KV, D, (H + 2 * KV) * D, H / KV, doc, float(1.0 / std::sqrt(double(D)))};
}

// Calls f.template operator()<D>() for the head dims built (the per-thread rows live in registers).
template <typename F>
void with_head_dim(int64_t D, F f) {
  switch (D) {
    case 16: return f.template operator()<16>();
    case 32: return f.template operator()<32>();
    case 64: return f.template operator()<64>();
    case 128: return f.template operator()<128>();
    default: throw Error(cat("CUDA attention: head dim ", D, " is not built (16, 32, 64 or 128)"));
  }
}

// delta[b,h,i] = Σ_d dout·out, FlashAttention-2's row term of the backward (queued on the stream); with
// round_dout, of dout rounded to bf16 (the bf16 kernels' dout).
void attention_delta(float* delta, const float* dout, const float* out, int64_t B, const Dims& m, bool round_dout);

}  // namespace origami::cuda
