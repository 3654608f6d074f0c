// AdamW with decoupled weight decay (PyTorch semantics) on ranges of the flat parameter buffer
// (all of it, or a ZeRO shard), and learning-rate schedules. Global-norm clipping is a gradient
// multiplier that step() applies as it reads the gradients (one pass over the buffer less than
// scaling them first); the norm comes from data parallelism (parallel/data_parallel.h), which knows
// how to compute the true global one.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "model/params.h"

namespace origami {

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.0;
};

class AdamW {
 public:
  // Updates the parameters in `ranges` of the buffer (empty: all of it); state exists only for them.
  // The update also writes the bf16 copy (Params::bf16_copy, where there is one) of the values it
  // updates within `copy_ranges` (DataParallel::copy_written_by_update), in the same pass.
  AdamW(const Params& params, AdamWConfig cfg, const std::vector<Range>& ranges = {},
        const std::vector<Range>& copy_ranges = {});
  // One update with learning rate lr on the gradients g·grad_scale: p −= lr·wd·p (matrices only),
  // then the bias-corrected Adam step p −= lr·m̂/(√v̂ + ε) (kernels/cpu/optimizer.h). The gradient
  // buffer is left unchanged.
  void step(Params& params, double lr, float grad_scale = 1.f);
  int64_t steps_taken() const { return t_; }
  void set_steps_taken(int64_t t) { t_ = t; }

  // State for checkpoints: the buffer segments this optimizer updates (in buffer order, one tensor
  // each) and their exp_avg / exp_avg_sq, segment i's elements back to back.
  const std::vector<Segment>& segments() const { return segs_; }
  float* exp_avg(size_t i) { return m_.data() + state_at_[i]; }
  float* exp_avg_sq(size_t i) { return v_.data() + state_at_[i]; }
  const float* exp_avg(size_t i) const { return m_.data() + state_at_[i]; }
  const float* exp_avg_sq(size_t i) const { return v_.data() + state_at_[i]; }
  // The segment holding buffer element `offset`, or -1.
  int64_t segment_of(int64_t offset) const;

 private:
  AdamWConfig cfg_;
  std::vector<Segment> segs_;
  std::vector<int64_t> state_at_;  // where each segment's state starts in m_ / v_
  std::vector<uint8_t> decay_;     // per segment
  std::vector<uint8_t> copy_;      // per segment: the update writes its bf16 copy
  std::vector<float> m_, v_;
  int64_t t_ = 0;
};

// The gradient multiplier of global-norm clipping (torch.nn.utils.clip_grad_norm_ semantics):
// max_norm/(norm + 1e-6) when max_norm > 0 and that is below 1, else 1.
float clip_coefficient(double norm, double max_norm);

enum class LrSchedule { constant, cosine };
LrSchedule parse_lr_schedule(const std::string& s);

struct LrConfig {
  double lr = 3e-4, min_lr = 0.0;
  int64_t warmup = 0, total_steps = 1;
  LrSchedule schedule = LrSchedule::cosine;
};
// Step s (0-based): linear warmup lr·(s+1)/W for s < W, then constant lr, or cosine from lr to
// min_lr over the remaining steps: min_lr + ½(lr − min_lr)(1 + cos(π·(s−W)/max(1, S−W))).
double lr_at(const LrConfig& c, int64_t step);

}  // namespace origami
