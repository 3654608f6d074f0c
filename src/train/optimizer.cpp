#include "train/optimizer.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/memory.h"

namespace origami {

AdamW::AdamW(const Params& params, AdamWConfig cfg, const std::vector<Range>& ranges) : cfg_(cfg) {
  segs_ = params.segments(ranges.empty() ? std::vector<Range>{{0, params.size()}} : ranges);
  int64_t n = 0;
  for (const Segment& s : segs_) {
    state_at_.push_back(n);
    decay_.push_back(params.table()[s.param].decays() ? 1 : 0);
    n += s.end - s.begin;
  }
  allocating("the AdamW moments", 8 * n, [&] {
    m_.assign(size_t(n), 0.f);
    v_.assign(size_t(n), 0.f);
  });
}

void AdamW::step(Params& params, double lr, float grad_scale) {
  ++t_;
  const double bc1 = 1.0 - std::pow(cfg_.beta1, double(t_)), bc2 = 1.0 - std::pow(cfg_.beta2, double(t_));
  const float b1 = float(cfg_.beta1), b2 = float(cfg_.beta2);
  const float step_size = float(lr / bc1), inv_sqrt_bc2 = float(1.0 / std::sqrt(bc2)), eps = float(cfg_.eps);
  // One parallel region for all segments (GPT-2 has 148, many of them bias vectors): a region per
  // segment cost ~10% of the step's time in thread wake-ups. Segments are disjoint, hence nowait.
#pragma omp parallel
  for (size_t i = 0; i < segs_.size(); ++i) {
    const int64_t n = segs_[i].end - segs_[i].begin;
    float* w = params.data() + segs_[i].begin;
    const float* g = params.grad() + segs_[i].begin;
    float* m = m_.data() + state_at_[i];
    float* v = v_.data() + state_at_[i];
    const float keep = decay_[i] ? float(1.0 - lr * cfg_.weight_decay) : 1.f;
#pragma omp for simd schedule(static) nowait
    for (int64_t j = 0; j < n; ++j) {
      const float gj = g[j] * grad_scale;
      m[j] = b1 * m[j] + (1.f - b1) * gj;
      v[j] = b2 * v[j] + (1.f - b2) * gj * gj;
      w[j] = w[j] * keep - step_size * m[j] / (std::sqrt(v[j]) * inv_sqrt_bc2 + eps);
    }
  }
}

int64_t AdamW::segment_of(int64_t offset) const {
  auto it = std::upper_bound(segs_.begin(), segs_.end(), offset, [](int64_t o, const Segment& s) { return o < s.end; });
  return it != segs_.end() && it->begin <= offset ? int64_t(it - segs_.begin()) : -1;
}

float clip_coefficient(double norm, double max_norm) {
  const double coef = max_norm / (norm + 1e-6);
  return max_norm > 0 && coef < 1.0 ? float(coef) : 1.f;
}

LrSchedule parse_lr_schedule(const std::string& s) {
  if (s == "constant") return LrSchedule::constant;
  if (s == "cosine") return LrSchedule::cosine;
  fail("--lr-schedule must be 'constant' or 'cosine', got '", s, "'");
}

double lr_at(const LrConfig& c, int64_t s) {
  if (s < c.warmup) return c.lr * double(s + 1) / double(c.warmup);
  if (c.schedule == LrSchedule::constant) return c.lr;
  const double progress = double(s - c.warmup) / double(std::max<int64_t>(1, c.total_steps - c.warmup));
  return c.min_lr + 0.5 * (c.lr - c.min_lr) * (1.0 + std::cos(M_PI * std::min(1.0, progress)));
}

}  // namespace origami
