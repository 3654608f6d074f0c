#include "parallel/tensor_parallel.h"

#include <cstring>

#include "core/error.h"
#include "model/layers/lm_head.h"

namespace origami {

namespace {
Comm& local_comm() {
  static std::unique_ptr<Comm> c = make_local_comm("tp");
  return *c;
}
}  // namespace

TensorParallel::TensorParallel() : comm_(&local_comm()) {}
TensorParallel::TensorParallel(Comm& tp, bool sequence_parallel) : comm_(&tp), sp_(sequence_parallel && tp.size() > 1) {}

void TensorParallel::to_shards(float* out, const float* in, int64_t B, int64_t T, int64_t C) const {
  const int64_t t = size(), Ts = T / t;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t r = 0; r < t; ++r)
    for (int64_t b = 0; b < B; ++b)
      std::memcpy(out + ((r * B + b) * Ts) * C, in + (b * T + r * Ts) * C, size_t(Ts * C) * sizeof(float));
}

void TensorParallel::from_shards(float* out, const float* in, int64_t B, int64_t T, int64_t C) const {
  const int64_t t = size(), Ts = T / t;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t r = 0; r < t; ++r)
    for (int64_t b = 0; b < B; ++b)
      std::memcpy(out + (b * T + r * Ts) * C, in + ((r * B + b) * Ts) * C, size_t(Ts * C) * sizeof(float));
}

void TensorParallel::gather(float* full, const float* shard, int64_t B, int64_t T, int64_t C) {
  const int64_t N = B * T;
  if (B == 1) {
    comm_->all_gather(full, shard, N / size() * C, DType::f32);
    return;
  }
  buf_.resize(size_t(N * C));
  comm_->all_gather(buf_.data(), shard, N / size() * C, DType::f32);
  from_shards(full, buf_.data(), B, T, C);
}

void TensorParallel::enter(float* full, const float* local, int64_t B, int64_t T, int64_t C) {
  if (!sp_) {
    ORIGAMI_ASSERT(full == local);
    return;
  }
  gather(full, local, B, T, C);
}

const float* TensorParallel::share(const float* local, float* scratch, int64_t B, int64_t T, int64_t C) const {
  if (whole_shares()) return local;
  const int64_t Ts = T / size(), r = rank();
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < B; ++b)
    std::memcpy(scratch + b * Ts * C, local + (b * T + r * Ts) * C, size_t(Ts * C) * sizeof(float));
  return scratch;
}

void TensorParallel::gather_shares(float* local, const float* share, int64_t B, int64_t T, int64_t C) {
  if (whole_shares()) {
    ORIGAMI_ASSERT(local == share);
    return;
  }
  gather(local, share, B, T, C);
}

void TensorParallel::enter_backward(float* d_local, float* d_full, int64_t B, int64_t T, int64_t C) {
  const int64_t N = B * T;
  if (!sp_) {
    ORIGAMI_ASSERT(d_local == d_full);
    comm_->all_reduce(d_full, N * C);
    return;
  }
  const float* in = d_full;
  if (B > 1) {
    buf_.resize(size_t(N * C));
    to_shards(buf_.data(), d_full, B, T, C);
    in = buf_.data();
  }
  comm_->reduce_scatter(d_local, in, N / size() * C, DType::f32);
}

void TensorParallel::exit(float* local, float* partial, int64_t B, int64_t T, int64_t C) {
  enter_backward(local, partial, B, T, C);  // the same collective: sum the partials, keep this rank's part
}

const float* TensorParallel::exit_backward(float* d_full, const float* d_local, int64_t B, int64_t T, int64_t C) {
  if (!sp_) return d_local;
  enter(d_full, d_local, B, T, C);  // the same collective: gather the shards
  return d_full;
}

void combine_vocab_stats(Comm& group, float* stats, int64_t n) {
  if (group.size() == 1) return;
  std::vector<float> all(size_t(group.size() * n * 3));
  group.all_gather(all.data(), stats, n * 3, DType::f32);
  merge_vocab_stats(stats, all.data(), group.size(), n);
}

}  // namespace origami
