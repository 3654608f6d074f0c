// AdamW with decoupled weight decay (PyTorch semantics) on the flat parameter buffer, global-norm
// gradient clipping (torch.nn.utils.clip_grad_norm_ semantics) and learning-rate schedules.
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
  AdamW(const Params& params, AdamWConfig cfg);
  // One update with learning rate lr: p −= lr·wd·p (matrices only), then the bias-corrected
  // Adam step p −= lr·m̂/(√v̂ + ε).
  void step(Params& params, double lr);
  int64_t steps_taken() const { return t_; }

  // State for checkpoints: exp_avg / exp_avg_sq in the parameter buffer's layout.
  std::vector<float>& exp_avg() { return m_; }
  std::vector<float>& exp_avg_sq() { return v_; }
  void set_steps_taken(int64_t t) { t_ = t; }

 private:
  AdamWConfig cfg_;
  std::vector<float> m_, v_;
  std::vector<uint8_t> decay_;  // per parameter tensor
  int64_t t_ = 0;
};

// √(Σ g²) over the whole gradient buffer, accumulated in double.
double grad_global_norm(const Params& params);
// Scales gradients by max_norm/(norm + 1e-6) when that is < 1. Returns the norm before clipping.
double clip_grad_norm(Params& params, double max_norm);

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
