#include "train/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace origami {

int32_t sample_token(const float* logits, int32_t vocab, double temperature, int32_t top_k, double u) {
  if (temperature == 0.0) return int32_t(std::max_element(logits, logits + vocab) - logits);
  std::vector<int32_t> idx(static_cast<size_t>(vocab));
  std::iota(idx.begin(), idx.end(), 0);
  const int32_t k = (top_k <= 0 || top_k > vocab) ? vocab : top_k;
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(),
                    [&](int32_t x, int32_t y) { return logits[x] > logits[y]; });
  std::vector<double> p(static_cast<size_t>(k));
  const double m = logits[idx[0]];
  double sum = 0;
  for (int32_t i = 0; i < k; ++i) sum += p[size_t(i)] = std::exp((logits[idx[size_t(i)]] - m) / temperature);
  double acc = 0;
  for (int32_t i = 0; i < k; ++i) {
    acc += p[size_t(i)] / sum;
    if (u < acc) return idx[size_t(i)];
  }
  return idx[size_t(k - 1)];
}

}  // namespace origami
