#include "train/optimizer.h"

#include <algorithm>
#include <cmath>


#include "core/error.h"
#include "core/memory.h"
#include "kernels/cpu/optimizer.h"
#include "kernels/cpu/parallel.h"

namespace origami {

AdamW::AdamW(const Params& params, AdamWConfig cfg, const std::vector<Range>& ranges,
             const std::vector<Range>& copy_ranges)
    : cfg_(cfg) {
  segs_ = params.segments(ranges.empty() ? std::vector<Range>{{0, params.size()}} : ranges);
  int64_t n = 0;
  for (const Segment& s : segs_) {
    state_at_.push_back(n);
    decay_.push_back(params.table()[s.param].decays() ? 1 : 0);
    const bool inside = std::any_of(copy_ranges.begin(), copy_ranges.end(),
                                    [&](const Range& r) { return r.begin <= s.begin && s.end <= r.end; });
    const bool touches = std::any_of(copy_ranges.begin(), copy_ranges.end(),
                                     [&](const Range& r) { return r.begin < s.end && s.begin < r.end; });
    ORIGAMI_ASSERT(inside == touches);  // a copy range holds whole segments
    copy_.push_back(inside);
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
  AdamWScalars s{float(cfg_.beta1), float(cfg_.beta2), float(lr / bc1), float(1.0 / std::sqrt(bc2)),
                 float(cfg_.eps),   1.f,                grad_scale};
  const float decayed = float(1.0 - lr * cfg_.weight_decay);
  bf16* low = params.bf16_copy();
  // One parallel region for all segments (GPT-2 has 148, many of them bias vectors): a region per
  // segment cost ~10% of the step's time in thread wake-ups. Each thread updates its share of each.
#pragma omp parallel firstprivate(s)
  {
    for (size_t i = 0; i < segs_.size(); ++i) {
      const auto [lo, hi] = my_share(segs_[i].end - segs_[i].begin);
      const int64_t at = segs_[i].begin + lo;
      s.keep = decay_[i] ? decayed : 1.f;
      adamw_update(params.data() + at, copy_[i] && low != nullptr ? low + at : nullptr, params.grad() + at,
                   m_.data() + state_at_[i] + lo, v_.data() + state_at_[i] + lo, hi - lo, s);
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
