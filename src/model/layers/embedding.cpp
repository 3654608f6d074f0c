#include "model/layers/embedding.h"

namespace origami {

template <typename T>
void embedding_forward(T* x, const int32_t* tokens, int64_t tok_stride, const T* wte, const T* wpe,
                       int64_t B, int64_t Tn, int64_t C, int64_t vocab_begin, int64_t vocab_rows, const int64_t* pos) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tn; ++t) {
      const int64_t row = int64_t(tokens[b * tok_stride + t]) - vocab_begin;
      const bool here = row >= 0 && row < vocab_rows;
      const T* e = wte + (here ? row : 0) * C;
      const T* p = wpe ? wpe + (pos ? pos[b * Tn + t] : t) * C : nullptr;
      T* xr = x + (b * Tn + t) * C;
      for (int64_t c = 0; c < C; ++c) xr[c] = (here ? e[c] : T(0)) + (p ? p[c] : T(0));
    }
}

template <typename T>
void embedding_backward(T* dwte, T* dwpe, const T* dx, const int32_t* tokens, int64_t tok_stride,
                        int64_t B, int64_t Tn, int64_t C, int64_t vocab_begin, int64_t vocab_rows, const int64_t* pos) {
  // Threads own disjoint channel ranges, so rows of the same token never race.
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t c0 = 0; c0 < C; c0 += 16) {
      const int64_t c1 = c0 + 16 < C ? c0 + 16 : C;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < Tn; ++t) {
          const T* d = dx + (b * Tn + t) * C;
          const int64_t row = int64_t(tokens[b * tok_stride + t]) - vocab_begin;
          if (row >= 0 && row < vocab_rows)
            for (int64_t c = c0; c < c1; ++c) dwte[row * C + c] += d[c];
          if (dwpe)
            for (int64_t c = c0; c < c1; ++c) dwpe[(pos ? pos[b * Tn + t] : t) * C + c] += d[c];
        }
    }
  }
}

#define INSTANTIATE(T)                                                                                            \
  template void embedding_forward<T>(T*, const int32_t*, int64_t, const T*, const T*, int64_t, int64_t, int64_t, int64_t, \
                                     int64_t, const int64_t*);                                                      \
  template void embedding_backward<T>(T*, T*, const T*, const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t,   \
                                      int64_t, const int64_t*);
INSTANTIATE(float)
INSTANTIATE(double)

}  // namespace origami
