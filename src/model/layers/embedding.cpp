#include "model/layers/embedding.h"

namespace origami {

template <typename T>
void embedding_forward(T* x, const int32_t* tokens, int64_t tok_stride, const T* wte, const T* wpe,
                       int64_t B, int64_t Tn, int64_t C) {
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tn; ++t) {
      const T* e = wte + int64_t(tokens[b * tok_stride + t]) * C;
      T* xr = x + (b * Tn + t) * C;
      if (wpe) {
        const T* p = wpe + t * C;
        for (int64_t c = 0; c < C; ++c) xr[c] = e[c] + p[c];
      } else {
        for (int64_t c = 0; c < C; ++c) xr[c] = e[c];
      }
    }
}

template <typename T>
void embedding_backward(T* dwte, T* dwpe, const T* dx, const int32_t* tokens, int64_t tok_stride,
                        int64_t B, int64_t Tn, int64_t C) {
  // Threads own disjoint channel ranges, so rows of the same token never race.
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t c0 = 0; c0 < C; c0 += 16) {
      const int64_t c1 = c0 + 16 < C ? c0 + 16 : C;
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < Tn; ++t) {
          const T* d = dx + (b * Tn + t) * C;
          T* g = dwte + int64_t(tokens[b * tok_stride + t]) * C;
          for (int64_t c = c0; c < c1; ++c) g[c] += d[c];
          if (dwpe)
            for (int64_t c = c0; c < c1; ++c) dwpe[t * C + c] += d[c];
        }
    }
  }
}

template void embedding_forward<float>(float*, const int32_t*, int64_t, const float*, const float*, int64_t, int64_t, int64_t);
template void embedding_forward<double>(double*, const int32_t*, int64_t, const double*, const double*, int64_t, int64_t, int64_t);
template void embedding_backward<float>(float*, float*, const float*, const int32_t*, int64_t, int64_t, int64_t, int64_t);
template void embedding_backward<double>(double*, double*, const double*, const int32_t*, int64_t, int64_t, int64_t, int64_t);

}  // namespace origami
