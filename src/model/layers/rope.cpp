#include "model/layers/rope.h"

#include <cmath>

namespace origami {

RopeTable::RopeTable(int64_t T, int64_t D, double theta) : max_T(T), half(D / 2) {
  cos.resize(size_t(T * half));
  sin.resize(size_t(T * half));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const double inv_freq = std::pow(theta, -2.0 * double(i) / double(D));
      cos[size_t(t * half + i)] = std::cos(double(t) * inv_freq);
      sin[size_t(t * half + i)] = std::sin(double(t) * inv_freq);
    }
}

// sign = +1 rotates by +angle (forward), −1 by −angle (backward: the transpose).
template <typename T>
static void rotate(T* qkv, const RopeTable& rt, int64_t B, int64_t Tn, int64_t H, int64_t KV, int64_t D,
                   const int64_t* pos, double sign) {
  const int64_t S = (H + 2 * KV) * D, half = D / 2;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tn; ++t) {
      T* row = qkv + (b * Tn + t) * S;
      const int64_t p = pos ? pos[b * Tn + t] : t;
      const double* c = rt.cos.data() + p * half;
      const double* s = rt.sin.data() + p * half;
      for (int64_t h = 0; h < H + KV; ++h) {  // q heads then k heads; v is untouched
        T* x = row + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const T x1 = x[i], x2 = x[i + half];
          const T ci = T(c[i]), si = T(sign * s[i]);
          x[i] = x1 * ci - x2 * si;
          x[i + half] = x2 * ci + x1 * si;
        }
      }
    }
}

template <typename T>
void rope_forward(T* qkv, const RopeTable& rt, int64_t B, int64_t Tn, int64_t H, int64_t KV, int64_t D,
                  const int64_t* pos) {
  rotate(qkv, rt, B, Tn, H, KV, D, pos, 1.0);
}
template <typename T>
void rope_backward(T* dqkv, const RopeTable& rt, int64_t B, int64_t Tn, int64_t H, int64_t KV, int64_t D,
                   const int64_t* pos) {
  rotate(dqkv, rt, B, Tn, H, KV, D, pos, -1.0);
}

template void rope_forward<float>(float*, const RopeTable&, int64_t, int64_t, int64_t, int64_t, int64_t, const int64_t*);
template void rope_forward<double>(double*, const RopeTable&, int64_t, int64_t, int64_t, int64_t, int64_t, const int64_t*);
template void rope_backward<float>(float*, const RopeTable&, int64_t, int64_t, int64_t, int64_t, int64_t, const int64_t*);
template void rope_backward<double>(double*, const RopeTable&, int64_t, int64_t, int64_t, int64_t, int64_t, const int64_t*);

}  // namespace origami
