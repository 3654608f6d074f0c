#include "model/layers/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/fast_math.h"
#include "kernels/cpu/gemm.h"

namespace origami {

namespace {
constexpr int64_t kBlock = 64;  // query and key tile size

// Keys of a tile row: query i (block row r of the tile at i0) sees keys j ≤ i + diag of the key
// tile at j0, i.e. the first `visible` of its nk keys (≤ 0: none).
inline int64_t visible(int64_t i0, int64_t r, int64_t j0, int64_t nk, int64_t diag) {
  return std::min(nk, i0 + r + diag - j0 + 1);
}
// Key tiles a query tile [i0, i0+nq) reaches: [0, key_end).
inline int64_t key_end(int64_t i0, int64_t nq, int64_t Tk, int64_t diag) {
  return std::min(Tk, i0 + nq + std::min(diag, Tk));
}

// The document mask of one batch row (BlockDims): a tile is empty when its last key's document
// precedes its first query's (documents are nondecreasing, so then every key's precedes every
// query's); a query row's first visible key of a tile is the first in its own document.
struct RowDocs {
  const int32_t *q = nullptr, *k = nullptr;  // null: no document mask
  RowDocs(const BlockDims& d, int64_t b) {
    if (d.qdoc) q = d.qdoc + b * d.doc_row, k = d.kdoc + b * d.doc_row;
  }
  bool empty_tile(int64_t i0, int64_t j0, int64_t nk) const { return q && k[j0 + nk - 1] < q[i0]; }
  int64_t first_key(int64_t i, int64_t j0, int64_t nk) const {
    return q ? std::lower_bound(k + j0, k + j0 + nk, q[i]) - (k + j0) : 0;
  }
};
}  // namespace

template <typename T>
int64_t attention_block_forward(Heads<T> out, Lse<T> lse, Heads<const T> q, Heads<const T> k, Heads<const T> v,
                                const BlockDims& dm) {
  const int64_t B = dm.B, Tq = dm.Tq, Tk = dm.Tk, H = dm.H, D = dm.D, group = dm.H / dm.KV;
  const T scale = T(1.0 / std::sqrt(double(D)));
  int64_t tiles = 0;
  tile_gemm_library();  // chosen here, outside the region (gemm.h)
#pragma omp parallel reduction(+ : tiles)
  {
    std::vector<T> scores(kBlock * kBlock), acc(kBlock * D), row_max(kBlock), row_sum(kBlock);
#pragma omp for collapse(2) schedule(dynamic)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t g = h / group;
        const T* Q = q.p + b * q.row + h * D;
        const T* K = k.p + b * k.row + g * D;
        const T* V = v.p + b * v.row + g * D;
        T* O = out.p + b * out.row + h * D;
        T* L = lse.p + b * lse.row + h * lse.head;
        const RowDocs docs(dm, b);
        for (int64_t i0 = 0; i0 < Tq; i0 += kBlock) {
          const int64_t nq = std::min(kBlock, Tq - i0), kend = key_end(i0, nq, Tk, dm.diag);
          if (kend <= 0) continue;
          // The running result in unnormalised form: acc = out·row_sum relative to row_max = lse.
          for (int64_t r = 0; r < nq; ++r) {
            row_max[r] = L[i0 + r];
            row_sum[r] = T(1);
            for (int64_t d = 0; d < D; ++d) acc[r * D + d] = O[(i0 + r) * out.tok + d];
          }
          for (int64_t j0 = 0; j0 < kend; j0 += kBlock) {
            const int64_t nk = std::min(kBlock, Tk - j0);
            if (docs.empty_tile(i0, j0, nk)) continue;
            ++tiles;
            // scores[nq, nk] = scale · Q_i·K_jᵀ
            gemm<T>(false, true, nq, nk, D, scale, Q + i0 * q.tok, q.tok, K + j0 * k.tok, k.tok, T(0), scores.data(),
                    kBlock);
            for (int64_t r = 0; r < nq; ++r) {
              T* p = scores.data() + r * kBlock;
              // This row sees keys [first, allowed) of the tile.
              const int64_t allowed = visible(i0, r, j0, nk, dm.diag), first = docs.first_key(i0 + r, j0, nk);
              if (allowed <= first) {
                std::fill(p, p + nk, T(0));
                continue;
              }
              T m = row_max[r];
              for (int64_t j = first; j < allowed; ++j) m = std::max(m, p[j]);
              const T rescale = std::exp(row_max[r] - m);  // 0 while no key was seen (−∞)
              T sum = 0;
              std::fill(p, p + first, T(0));
              for (int64_t j = first; j < allowed; ++j) {
                p[j] = exp_fast(p[j] - m);
                sum += p[j];
              }
              std::fill(p + allowed, p + nk, T(0));
              row_sum[r] = row_sum[r] * rescale + sum;
              row_max[r] = m;
              T* a = acc.data() + r * D;
              for (int64_t d = 0; d < D; ++d) a[d] *= rescale;
            }
            // acc[nq, D] += P·V_j
            gemm<T>(false, false, nq, D, nk, T(1), scores.data(), kBlock, V + j0 * v.tok, v.tok, T(1), acc.data(), D);
          }
          for (int64_t r = 0; r < nq; ++r) {
            T* o = O + (i0 + r) * out.tok;
            const T inv = T(1) / row_sum[r];
            for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
            L[i0 + r] = row_max[r] + std::log(row_sum[r]);
          }
        }
      }
  }
  return tiles;
}

template <typename T>
int64_t attention_block_backward(Heads<T> dq, Heads<T> dk, Heads<T> dv, Heads<const T> dout, Heads<const T> q,
                                 Heads<const T> k, Heads<const T> v, Heads<const T> out, Lse<const T> lse,
                                 const BlockDims& dm) {
  const int64_t B = dm.B, Tq = dm.Tq, Tk = dm.Tk, D = dm.D, KV = dm.KV, group = dm.H / dm.KV;
  const T scale = T(1.0 / std::sqrt(double(D)));
  int64_t tiles = 0;
  tile_gemm_library();  // chosen here, outside the region (gemm.h)
  // One task per (batch row, kv head): it owns dK, dV of that kv head and dQ of its query heads.
#pragma omp parallel reduction(+ : tiles)
  {
    std::vector<T> prob(kBlock * kBlock), dprob(kBlock * kBlock), delta(static_cast<size_t>(Tq));
#pragma omp for collapse(2) schedule(dynamic)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t g = 0; g < KV; ++g) {
        const T* K = k.p + b * k.row + g * D;
        const T* V = v.p + b * v.row + g * D;
        T* dK = dk.p + b * dk.row + g * D;
        T* dV = dv.p + b * dv.row + g * D;
        const RowDocs docs(dm, b);
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          const T* Q = q.p + b * q.row + h * D;
          T* dQ = dq.p + b * dq.row + h * D;
          const T* O = out.p + b * out.row + h * D;
          const T* dO = dout.p + b * dout.row + h * D;
          const T* L = lse.p + b * lse.row + h * lse.head;
          for (int64_t t = 0; t < Tq; ++t) {
            T s = 0;
            for (int64_t d = 0; d < D; ++d) s += dO[t * dout.tok + d] * O[t * out.tok + d];
            delta[size_t(t)] = s;  // Σ_d dO·O = Σ_j P_ij·dP_ij over all keys of the query row
          }
          for (int64_t i0 = 0; i0 < Tq; i0 += kBlock) {
            const int64_t nq = std::min(kBlock, Tq - i0), kend = key_end(i0, nq, Tk, dm.diag);
            for (int64_t j0 = 0; j0 < kend; j0 += kBlock) {
              const int64_t nk = std::min(kBlock, Tk - j0);
              if (docs.empty_tile(i0, j0, nk)) continue;
              ++tiles;
              gemm<T>(false, true, nq, nk, D, scale, Q + i0 * q.tok, q.tok, K + j0 * k.tok, k.tok, T(0), prob.data(),
                      kBlock);
              for (int64_t r = 0; r < nq; ++r) {  // P of keys [first, allowed), 0 elsewhere
                T* p = prob.data() + r * kBlock;
                const int64_t allowed = std::max<int64_t>(0, visible(i0, r, j0, nk, dm.diag));
                const int64_t first = std::min(allowed, docs.first_key(i0 + r, j0, nk));
                std::fill(p, p + first, T(0));
                for (int64_t j = first; j < allowed; ++j) p[j] = exp_fast(p[j] - L[i0 + r]);
                std::fill(p + allowed, p + nk, T(0));
              }
              // dV_j += Pᵀ·dO_i ; dP = dO_i·V_jᵀ
              gemm<T>(true, false, nk, D, nq, T(1), prob.data(), kBlock, dO + i0 * dout.tok, dout.tok, T(1),
                      dV + j0 * dv.tok, dv.tok);
              gemm<T>(false, true, nq, nk, D, T(1), dO + i0 * dout.tok, dout.tok, V + j0 * v.tok, v.tok, T(0),
                      dprob.data(), kBlock);
              // dS = P ∘ (dP − delta_i)
              for (int64_t r = 0; r < nq; ++r) {
                T *p = prob.data() + r * kBlock, *dp = dprob.data() + r * kBlock;
                const T dl = delta[size_t(i0 + r)];
                for (int64_t j = 0; j < nk; ++j) dp[j] = p[j] * (dp[j] - dl);
              }
              // dQ_i += scale·dS·K_j ; dK_j += scale·dSᵀ·Q_i
              gemm<T>(false, false, nq, D, nk, scale, dprob.data(), kBlock, K + j0 * k.tok, k.tok, T(1),
                      dQ + i0 * dq.tok, dq.tok);
              gemm<T>(true, false, nk, D, nq, scale, dprob.data(), kBlock, Q + i0 * q.tok, q.tok, T(1),
                      dK + j0 * dk.tok, dk.tok);
            }
          }
        }
      }
  }
  return tiles;
}

// The whole sequence is one causal block over the packed qkv rows (documents: the same ids for both).
template <typename T>
int64_t attention_forward(T* out, T* lse, const T* qkv, int64_t B, int64_t Tn, int64_t H, int64_t KV, int64_t D,
                          const int32_t* doc) {
  const int64_t S = (H + 2 * KV) * D, HD = H * D;
  std::fill(out, out + B * Tn * HD, T(0));
  std::fill(lse, lse + B * H * Tn, -std::numeric_limits<T>::infinity());
  return attention_block_forward<T>({out, Tn * HD, HD}, {lse, H * Tn, Tn}, {qkv, Tn * S, S}, {qkv + H * D, Tn * S, S},
                                    {qkv + (H + KV) * D, Tn * S, S}, {B, Tn, Tn, H, KV, D, 0, doc, doc, Tn});
}

template <typename T>
int64_t attention_backward(T* dqkv, const T* dout, const T* qkv, const T* out, const T* lse, int64_t B, int64_t Tn,
                           int64_t H, int64_t KV, int64_t D, const int32_t* doc) {
  const int64_t S = (H + 2 * KV) * D, HD = H * D;
  std::fill(dqkv, dqkv + B * Tn * S, T(0));
  return attention_block_backward<T>({dqkv, Tn * S, S}, {dqkv + H * D, Tn * S, S}, {dqkv + (H + KV) * D, Tn * S, S},
                                     {dout, Tn * HD, HD}, {qkv, Tn * S, S}, {qkv + H * D, Tn * S, S},
                                     {qkv + (H + KV) * D, Tn * S, S}, {out, Tn * HD, HD}, {lse, H * Tn, Tn},
                                     {B, Tn, Tn, H, KV, D, 0, doc, doc, Tn});
}

#define ORIGAMI_ATTENTION(T)                                                                                        \
  template int64_t attention_forward<T>(T*, T*, const T*, int64_t, int64_t, int64_t, int64_t, int64_t,          \
                                        const int32_t*);                                                            \
  template int64_t attention_backward<T>(T*, const T*, const T*, const T*, const T*, int64_t, int64_t, int64_t,     \
                                         int64_t, int64_t, const int32_t*);                                         \
  template int64_t attention_block_forward<T>(Heads<T>, Lse<T>, Heads<const T>, Heads<const T>, Heads<const T>,     \
                                              const BlockDims&);                                                    \
  template int64_t attention_block_backward<T>(Heads<T>, Heads<T>, Heads<T>, Heads<const T>, Heads<const T>,        \
                                               Heads<const T>, Heads<const T>, Heads<const T>, Lse<const T>,        \
                                               const BlockDims&);
ORIGAMI_ATTENTION(float)
ORIGAMI_ATTENTION(double)
#undef ORIGAMI_ATTENTION

}  // namespace origami
