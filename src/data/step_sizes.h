// The step size of each stretch of a run — its global batch in windows (--batching windows) or its
// tokens per step (documents) — from the step a resume changed it on. A step's data are where the
// sizes the run trained with leave them, so a resume under another size neither skips nor repeats
// data (as Megatron's consumed-samples count), and a resume of that run replays the same stretches.
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

namespace origami {

class StepSizes {
 public:
  using Stretch = std::pair<int64_t, int64_t>;  // {first step, size}
  explicit StepSizes(int64_t size) : stretches_{{0, size}} {}
  // Stretches in increasing first steps, the first at step 0, each size at least 1: an Error naming
  // `what` otherwise (a checkpoint's trainer state).
  StepSizes(std::vector<Stretch> stretches, const char* what);

  int64_t size(int64_t step) const;    // the size of step `step` (0-based)
  int64_t before(int64_t step) const;  // the sizes of steps 0 .. step−1 summed (windows: step's first sample)
  int64_t largest() const;
  // These sizes up to step `step`, then `size` from it on (a resume at `step`).
  StepSizes resumed(int64_t step, int64_t size) const;
  const std::vector<Stretch>& stretches() const { return stretches_; }

 private:
  std::vector<Stretch> stretches_;
};

}  // namespace origami
