#include "data/step_sizes.h"

#include <algorithm>

#include "core/checked.h"
#include "core/error.h"

namespace origami {

StepSizes::StepSizes(std::vector<Stretch> stretches, const char* what) : stretches_(std::move(stretches)) {
  ORIGAMI_CHECK(!stretches_.empty() && stretches_[0].first == 0, what, ": step_sizes must start at step 0");
  for (size_t i = 0; i < stretches_.size(); ++i) {
    ORIGAMI_CHECK(stretches_[i].second >= 1, what, ": step_sizes: size ", stretches_[i].second, " at step ",
                  stretches_[i].first, " must be at least 1");
    ORIGAMI_CHECK(i == 0 || stretches_[i].first > stretches_[i - 1].first, what,
                  ": step_sizes: the steps must increase (", stretches_[i - 1].first, " then ", stretches_[i].first, ")");
  }
}

int64_t StepSizes::size(int64_t step) const {
  auto it = std::upper_bound(stretches_.begin(), stretches_.end(), step,
                             [](int64_t s, const Stretch& r) { return s < r.first; });
  return std::prev(it)->second;
}

int64_t StepSizes::before(int64_t step) const {
  Size total = 0;  // (checked: a position past int64 throws rather than wrapping)
  for (size_t i = 0; i < stretches_.size() && stretches_[i].first < step; ++i) {
    const int64_t end = i + 1 < stretches_.size() ? std::min(step, stretches_[i + 1].first) : step;
    total += Size(end - stretches_[i].first) * stretches_[i].second;
  }
  return total.get();
}

int64_t StepSizes::largest() const {
  int64_t most = 0;
  for (const Stretch& r : stretches_) most = std::max(most, r.second);
  return most;
}

StepSizes StepSizes::resumed(int64_t step, int64_t size) const {
  StepSizes out = *this;
  auto& s = out.stretches_;
  while (!s.empty() && s.back().first >= step) s.pop_back();  // stretches a resume from an earlier step drops
  if (s.empty() || s.back().second != size) s.push_back({step, size});
  return out;
}

}  // namespace origami
