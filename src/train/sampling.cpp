#include "train/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace origami {

namespace {
// A logit as sampling orders it: NaN as −inf (never drawn, and the sort keeps a strict order).
double key(const float* logits, int32_t i) {
  return std::isnan(logits[i]) ? -std::numeric_limits<double>::infinity() : double(logits[i]);
}
}  // namespace

int32_t sample_token(const float* logits, int32_t vocab, double temperature, int32_t top_k, double u) {
  std::vector<int32_t> idx(static_cast<size_t>(vocab));
  std::iota(idx.begin(), idx.end(), 0);
  auto more_likely = [&](int32_t x, int32_t y) { return key(logits, x) > key(logits, y); };
  if (temperature == 0.0) return *std::min_element(idx.begin(), idx.end(), more_likely);  // (the first of ties)
  const int32_t k = (top_k <= 0 || top_k > vocab) ? vocab : top_k;
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), more_likely);
  const double m = key(logits, idx[0]);
  if (!std::isfinite(m)) return idx[0];  // no finite logit to weigh against (+inf: that token)
  std::vector<double> p(static_cast<size_t>(k));
  double sum = 0;
  for (int32_t i = 0; i < k; ++i) sum += p[size_t(i)] = std::exp((key(logits, idx[size_t(i)]) - m) / temperature);
  double acc = 0;
  int32_t last = idx[0];  // the last token of non-zero probability: where rounding leaves acc below u
  for (int32_t i = 0; i < k; ++i) {
    if (p[size_t(i)] == 0) break;  // (sorted: the rest are zero too)
    acc += p[size_t(i)] / sum;
    last = idx[size_t(i)];
    if (u < acc) return last;
  }
  return last;
}

}  // namespace origami
