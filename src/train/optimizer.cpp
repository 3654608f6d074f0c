#include "train/optimizer.h"

#include <cmath>

#include "core/error.h"

namespace origami {

AdamW::AdamW(const Params& params, AdamWConfig cfg)
    : cfg_(cfg), m_(size_t(params.size()), 0.f), v_(size_t(params.size()), 0.f) {
  for (const ParamSpec& p : params.table()) decay_.push_back(p.decays() ? 1 : 0);
}

void AdamW::step(Params& params, double lr) {
  ++t_;
  const double bc1 = 1.0 - std::pow(cfg_.beta1, double(t_)), bc2 = 1.0 - std::pow(cfg_.beta2, double(t_));
  const float b1 = float(cfg_.beta1), b2 = float(cfg_.beta2);
  const float step_size = float(lr / bc1), inv_sqrt_bc2 = float(1.0 / std::sqrt(bc2)), eps = float(cfg_.eps);
  float* w = params.data();
  const float* g = params.grad();
  for (size_t i = 0; i < params.table().size(); ++i) {
    const int64_t begin = params.offset(i), end = begin + params.table()[i].numel();
    const float keep = decay_[i] ? float(1.0 - lr * cfg_.weight_decay) : 1.f;
#pragma omp parallel for simd schedule(static)
    for (int64_t j = begin; j < end; ++j) {
      m_[size_t(j)] = b1 * m_[size_t(j)] + (1.f - b1) * g[j];
      v_[size_t(j)] = b2 * v_[size_t(j)] + (1.f - b2) * g[j] * g[j];
      w[j] = w[j] * keep - step_size * m_[size_t(j)] / (std::sqrt(v_[size_t(j)]) * inv_sqrt_bc2 + eps);
    }
  }
}

double grad_global_norm(const Params& params) {
  const float* g = params.grad();
  double s = 0;
#pragma omp parallel for simd reduction(+ : s) schedule(static)
  for (int64_t i = 0; i < params.size(); ++i) s += double(g[i]) * g[i];
  return std::sqrt(s);
}

double clip_grad_norm(Params& params, double max_norm) {
  const double norm = grad_global_norm(params);
  const double coef = max_norm / (norm + 1e-6);
  if (max_norm > 0 && coef < 1.0) {
    float* g = params.grad();
    const float c = float(coef);
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < params.size(); ++i) g[i] *= c;
  }
  return norm;
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
