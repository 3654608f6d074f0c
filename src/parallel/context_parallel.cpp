#include "parallel/context_parallel.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>

#include "core/checked.h"
#include "core/error.h"
#include "core/timer.h"
#include "model/layers/attention.h"

namespace origami {

CpComm parse_cp_comm(const std::string& s) {
  if (s == "p2p") return CpComm::p2p;
  if (s == "a2a") return CpComm::a2a;
  if (s == "a2a+p2p") return CpComm::a2a_p2p;
  fail("--cp-comm '", s, "' is not one of p2p (ring), a2a (Ulysses all-to-all), a2a+p2p (all-to-all inside groups of "
       "--cp-a2a-size ranks, ring across them)");
}

const char* cp_comm_name(CpComm c) {
  switch (c) {
    case CpComm::p2p: return "p2p";
    case CpComm::a2a: return "a2a";
    case CpComm::a2a_p2p: return "a2a+p2p";
  }
  return "?";
}

// Checked (core/checked.h): N() itself is B·Tl, the model's checked token count.
int64_t CpShape::core_floats() const {
  const Size N = this->N(), kept = N * H * D + Size(B) * H * Tl;
  return (a2a > 1 ? kept + a2a * N * Sa() + N * H * D : kept).get();
}

std::vector<int> cp_degrees(int C) {
  std::vector<int> d;
  for (int k = 1; k < C; k *= 2)
    if (C % k == 0) d.push_back(k);
  d.push_back(C);
  return d;
}

int64_t CpShape::workspace_floats() const {
  const Size N = this->N();
  const Size heads = a2a > 1 ? 2 * a2a * N * Sa() + N * H * D : 0;  // staging, d_q|k|v and d_out heads
  const Size ring = rings() > 1 ? 5 * a2a * N * W() : 0;              // k|v ×2, gradients ×3
  return (heads + ring).get();
}

int64_t CpShape::forward_bytes() const {
  return 4 * N() * ((a2a - 1) * (Sa() + Ha() * D) + (rings() - 1) * a2a * W());
}

int64_t CpShape::backward_bytes() const {
  const int64_t ring_sends = rings() > 1 ? 2 * rings() - 1 : 0;
  return 4 * N() * ((a2a - 1) * (Sa() + Ha() * D) + ring_sends * a2a * W());
}

namespace {
constexpr int kTagKv = 71, kTagDkv = 72;

// k and v rows inside a buffer of `tok` floats per token: k heads at +k, v heads at +v.
template <typename P>
struct KvRows {
  P p;
  int64_t tok, k, v;
};

// One ring transfer pair (send to the next group, receive from the previous) and its timers.
struct Transfer {
  Request send, recv;
  Timer posted;
  double done_ms = -1;
  void progress() {
    send.test();
    recv.test();
    if (done_ms < 0 && !send.pending() && !recv.pending()) done_ms = posted.ms();
  }
  void wait(CpCounters& t) {
    Timer w;
    send.wait();
    recv.wait();
    t.wait_s += w.ms() / 1e3;
    t.transfer_s += (done_ms >= 0 ? done_ms : posted.ms()) / 1e3;
  }
};

// dst [A][N][W] += src (k|v rows of every source).
void add(float* dst, const float* src, int64_t n) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}
}  // namespace

// The head-sharded buffers of one call, [A sources][B][Tl][width] (A = 1: the sequence-sharded ones).
struct ContextParallel::Views {
  CpShape s;
  const float* qkv = nullptr;  // width Sa: q (Ha heads) | k (KVa) | v (KVa)
  float* dqkv = nullptr;
  float* out = nullptr;  // width Ha·D
  const float* dout = nullptr;
  float* lse = nullptr;  // [A][B][Ha][Tl]
  KvRows<const float*> kv{};  // the k|v attended now (this rank's own, or a ring buffer)
  KvRows<float*> dkv{};       // where their gradients accumulate
  const int32_t* doc = nullptr;  // [B, T] document of each position of the whole sequence (null: causal)
};

ContextParallel::ContextParallel() : a2a_(make_local_comm("cp-a2a")), ring_(make_local_comm("cp-ring")) {}

ContextParallel::ContextParallel(Comm& cp, CpComm kind, int a2a_size)
    : size_(cp.size()), rank_(cp.rank()), kind_(kind) {
  ORIGAMI_ASSERT(a2a_size >= 1 && size_ % a2a_size == 0);
  const int group = rank_ / a2a_size, member = rank_ % a2a_size;
  a2a_ = cp.split(group, member, "cp-a2a");
  ring_ = cp.split(member, group, "cp-ring");
}

int64_t ContextParallel::position(int64_t t, int64_t Tl) const {
  const int64_t m = Tl / 2;
  return t < m ? rank_ * m + t : (2 * size_ - 1 - rank_) * m + (t - m);
}

void ContextParallel::reset_counters() {
  a2a_->reset_bytes();
  ring_->reset_bytes();
  counters_ = {};
}

std::string ContextParallel::describe(int64_t kv_heads) const {
  std::string d = cp_comm_name(kind_);
  if (kind_ == CpComm::a2a_p2p) d += cat(" (all-to-all in groups of ", a2a_size(), ", ring of ", ring_->size(), ")");
  if (a2a_size() > 1 && kv_heads < a2a_size())
    d += cat(", ", kv_heads, " kv head", kv_heads == 1 ? "" : "s", " replicated to ", a2a_size(), " ranks");
  return d;
}

void ContextParallel::reserve(const CpShape& s) {
  const int64_t A = s.a2a, N = s.N();
  auto size = [](std::vector<float>& v, int64_t n) { v.assign(size_t(n), 0.f); };
  size(stage_, A > 1 ? A * N * s.Sa() : 0);
  size(dqkv_h_, A > 1 ? A * N * s.Sa() : 0);
  size(dout_h_, A > 1 ? N * s.H * s.D : 0);
  const int64_t ring = s.rings() > 1 ? A * N * s.W() : 0;
  for (auto* v : {&kv_[0], &kv_[1], &dkv_[0], &dkv_[1], &dkv_in_}) size(*v, ring);
}

// ---- The blocks ----

// Calls fn(q0, k0, lse0, mask) for each (query chunk, key chunk) block of this rank's queries against
// ring group kv_group's keys, skipping those whose keys all follow their queries (empty under the
// causal mask), then progress(). q0 and k0 are the chunks' first rows in the [A][B][Tl] row space of
// the head-sharded buffers (times a buffer's row width for an offset), lse0 the query chunk's first
// log-sum-exp entry, mask the block's dimensions and mask (attention.h; documents from `doc`).
template <typename F>
void ContextParallel::for_each_block(const CpShape& s, const int32_t* doc, int kv_group,
                                     const std::function<void()>& progress, F&& fn) {
  const int A = s.a2a, group = rank_ / A;
  const int64_t B = s.B, Tl = s.Tl, m = Tl / 2;
  for (int sq = 0; sq < A; ++sq)
    for (int eq = 0; eq < 2; ++eq)
      for (int sk = 0; sk < A; ++sk)
        for (int ek = 0; ek < 2; ++ek) {
          const int64_t cq = chunk(group * A + sq, eq), ck = chunk(kv_group * A + sk, ek);
          if (cq < ck) continue;
          BlockDims mask{B, m, m, s.Ha(), s.KVa(), s.D, cq == ck ? 0 : kAllKeys};
          mask.precision = s.precision, mask.qkv_exact = s.qkv_exact;
          if (doc) mask.qdoc = doc + cq * m, mask.kdoc = doc + ck * m, mask.doc_row = 2 * size_ * m;
          fn(sq * B * Tl + eq * m, sk * B * Tl + ek * m, sq * B * s.Ha() * Tl + eq * m, mask);
          progress();
        }
}

void ContextParallel::forward_blocks(const Views& v, int kv_group, const std::function<void()>& progress) {
  const CpShape& s = v.s;
  const int64_t B = s.B, Tl = s.Tl, m = Tl / 2, Ha = s.Ha(), D = s.D, Sa = s.Sa(), HaD = Ha * D, kt = v.kv.tok;
  for_each_block(s, v.doc, kv_group, progress, [&](int64_t q0, int64_t k0, int64_t lse0, const BlockDims& mask) {
    counters_.tiles += attention_block_forward<float>(
        {v.out + q0 * HaD, Tl * HaD, HaD}, {v.lse + lse0, Ha * Tl, Tl}, {v.qkv + q0 * Sa, Tl * Sa, Sa},
        {v.kv.p + k0 * kt + v.kv.k, Tl * kt, kt}, {v.kv.p + k0 * kt + v.kv.v, Tl * kt, kt}, mask);
    counters_.pairs += B * Ha * (mask.diag == 0 ? m * (m + 1) / 2 : m * m);
  });
}

void ContextParallel::backward_blocks(const Views& v, int kv_group, const std::function<void()>& progress) {
  const CpShape& s = v.s;
  const int64_t Tl = s.Tl, Ha = s.Ha(), D = s.D, Sa = s.Sa(), HaD = Ha * D, kt = v.kv.tok, dt = v.dkv.tok;
  for_each_block(s, v.doc, kv_group, progress, [&](int64_t q0, int64_t k0, int64_t lse0, const BlockDims& mask) {
    attention_block_backward<float>(
        {v.dqkv + q0 * Sa, Tl * Sa, Sa}, {v.dkv.p + k0 * dt + v.dkv.k, Tl * dt, dt},
        {v.dkv.p + k0 * dt + v.dkv.v, Tl * dt, dt}, {v.dout + q0 * HaD, Tl * HaD, HaD}, {v.qkv + q0 * Sa, Tl * Sa, Sa},
        {v.kv.p + k0 * kt + v.kv.k, Tl * kt, kt}, {v.kv.p + k0 * kt + v.kv.v, Tl * kt, kt},
        {v.out + q0 * HaD, Tl * HaD, HaD}, {v.lse + lse0, Ha * Tl, Tl}, mask);
  });
}

// ---- Forward and backward ----

namespace {
// The first kv head a2a rank r's query heads read (KV < A: the one they share, replicated).
int64_t kv_first(const CpShape& s, int r) { return s.KV >= s.a2a ? r * s.KVa() : r * s.KV / s.a2a; }

// Own k|v rows [A][N][Sa] (head-sharded q|k|v) → a ring buffer [A][N][W].
void pack_kv(float* kv, const float* qkv, const CpShape& s) {
  const int64_t rows = s.a2a * s.N(), Sa = s.Sa(), W = s.W(), off = s.Ha() * s.D;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < rows; ++n) std::memcpy(kv + n * W, qkv + n * Sa + off, size_t(W) * sizeof(float));
}
}  // namespace

void ContextParallel::forward(float* out, float* lse, float* qkv_h, float* out_h, const float* qkv, const CpShape& s,
                              const int32_t* doc) {
  if (size_ == 1) {  // the whole sequence
    counters_.tiles += attention_forward(out, lse, qkv, s.B, s.Tl, s.H, s.KV, s.D, doc, s.precision, s.qkv_exact);
    counters_.pairs += s.B * s.H * s.Tl * (s.Tl + 1) / 2;
    return;
  }
  const int A = s.a2a, R = s.rings(), group = rank_ / A;
  const int64_t N = s.N(), S = (s.H + 2 * s.KV) * s.D, HD = s.H * s.D, Ha = s.Ha(), D = s.D, Sa = s.Sa();
  Views v{s};
  v.doc = doc;
  if (A > 1) {
    // Sequence → heads: to a2a rank r, every token's q heads of r and the kv heads they read.
    for (int r = 0; r < A; ++r) {
      const int64_t kf = kv_first(s, r), KVa = s.KVa();
#pragma omp parallel for schedule(static)
      for (int64_t n = 0; n < N; ++n) {
        float* dst = stage_.data() + (r * N + n) * Sa;
        const float* src = qkv + n * S;
        std::memcpy(dst, src + r * Ha * D, size_t(Ha * D) * sizeof(float));
        std::memcpy(dst + Ha * D, src + (s.H + kf) * D, size_t(KVa * D) * sizeof(float));
        std::memcpy(dst + (Ha + KVa) * D, src + (s.H + s.KV + kf) * D, size_t(KVa * D) * sizeof(float));
      }
    }
    a2a_->all_to_all(qkv_h, stage_.data(), N * Sa, DType::f32);
    v.qkv = qkv_h, v.out = out_h;
  } else {
    v.qkv = qkv, v.out = out;
  }
  v.lse = lse;
  std::fill(v.out, v.out + N * HD, 0.f);
  std::fill(lse, lse + s.B * s.H * s.Tl, -std::numeric_limits<float>::infinity());
  v.kv = {v.qkv, Sa, Ha * D, (Ha + s.KVa()) * D};  // this rank's own k|v first
  if (R == 1) {
    forward_blocks(v, group, [] {});
  } else {
    const int next = (group + 1) % R, prev = (group + R - 1) % R;
    const int64_t n = A * N * s.W();
    pack_kv(kv_[0].data(), v.qkv, s);
    for (int r = 0, cur = 0; r < R; ++r, cur ^= 1) {
      Transfer t;
      if (r < R - 1) {
        t.send = ring_->isend(kv_[cur].data(), n, DType::f32, next, kTagKv);
        t.recv = ring_->irecv(kv_[cur ^ 1].data(), n, DType::f32, prev, kTagKv);
      }
      forward_blocks(v, (group + R - r) % R, [&] { t.progress(); });
      if (r < R - 1) {
        t.wait(counters_);
        v.kv = {kv_[cur ^ 1].data(), s.W(), 0, s.KVa() * D};
      }
    }
  }
  if (A > 1) {  // heads → sequence: out_h's block r goes back to a2a rank r
    a2a_->all_to_all(stage_.data(), out_h, N * Ha * D, DType::f32);
    for (int r = 0; r < A; ++r)
#pragma omp parallel for schedule(static)
      for (int64_t n = 0; n < N; ++n)
        std::memcpy(out + n * HD + r * Ha * D, stage_.data() + (r * N + n) * Ha * D, size_t(Ha * D) * sizeof(float));
  }
}

void ContextParallel::backward(float* dqkv, const float* dout, const float* qkv, const float* lse, const float* qkv_h,
                               const float* out, const float* out_h, const CpShape& s, const int32_t* doc) {
  if (size_ == 1) {
    attention_backward(dqkv, dout, qkv, out, lse, s.B, s.Tl, s.H, s.KV, s.D, doc, s.precision, s.qkv_exact);
    return;
  }
  const int A = s.a2a, R = s.rings(), group = rank_ / A;
  const int64_t N = s.N(), S = (s.H + 2 * s.KV) * s.D, HD = s.H * s.D, Ha = s.Ha(), KVa = s.KVa(), D = s.D,
                Sa = s.Sa(), W = s.W();
  Views v{s};
  v.doc = doc;
  if (A > 1) {  // d_out sequence → heads, as forward's q|k|v
    for (int r = 0; r < A; ++r)
#pragma omp parallel for schedule(static)
      for (int64_t n = 0; n < N; ++n)
        std::memcpy(stage_.data() + (r * N + n) * Ha * D, dout + n * HD + r * Ha * D, size_t(Ha * D) * sizeof(float));
    a2a_->all_to_all(dout_h_.data(), stage_.data(), N * Ha * D, DType::f32);
    v.qkv = qkv_h, v.out = const_cast<float*>(out_h), v.dout = dout_h_.data(), v.dqkv = dqkv_h_.data();
  } else {
    v.qkv = qkv, v.out = const_cast<float*>(out), v.dout = dout, v.dqkv = dqkv;
  }
  v.lse = const_cast<float*>(lse);
  std::fill(v.dqkv, v.dqkv + A * N * Sa, 0.f);
  v.kv = {v.qkv, Sa, Ha * D, (Ha + KVa) * D};
  v.dkv = {v.dqkv, Sa, Ha * D, (Ha + KVa) * D};
  if (R == 1) {
    backward_blocks(v, group, [] {});
  } else {
    // k|v travel as in forward; each step's gradient part for the k|v held is added to the
    // accumulator arriving from the previous group (sent there after its own step) and sent on; after
    // R steps the accumulator of this rank's k|v arrives home.
    const int next = (group + 1) % R, prev = (group + R - 1) % R;
    const int64_t n = A * N * W;
    pack_kv(kv_[0].data(), v.qkv, s);
    Transfer grads;  // the accumulator sent on and the next one received
    for (int r = 0, cur = 0; r < R; ++r, cur ^= 1) {
      Transfer t;
      if (r < R - 1) {
        t.send = ring_->isend(kv_[cur].data(), n, DType::f32, next, kTagKv);
        t.recv = ring_->irecv(kv_[cur ^ 1].data(), n, DType::f32, prev, kTagKv);
      }
      std::fill(dkv_[cur].begin(), dkv_[cur].end(), 0.f);
      v.dkv = {dkv_[cur].data(), W, 0, KVa * D};
      backward_blocks(v, (group + R - r) % R, [&] {
        t.progress();
        grads.progress();
      });
      if (r > 0) {
        grads.wait(counters_);
        add(dkv_[cur].data(), dkv_in_.data(), n);
      }
      grads = Transfer{};
      grads.send = ring_->isend(dkv_[cur].data(), n, DType::f32, next, kTagDkv);
      grads.recv = ring_->irecv(dkv_in_.data(), n, DType::f32, prev, kTagDkv);
      if (r < R - 1) {
        t.wait(counters_);
        v.kv = {kv_[cur ^ 1].data(), W, 0, KVa * D};
      }
    }
    grads.wait(counters_);
    // This rank's own k|v gradient, home: into the head-sharded d_q|k|v.
    const int64_t rows = A * N;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
      float* d = v.dqkv + i * Sa + Ha * D;
      const float* g = dkv_in_.data() + i * W;
      for (int64_t j = 0; j < W; ++j) d[j] += g[j];
    }
  }
  if (A > 1) {  // d_q|k|v heads → sequence; replicated kv heads sum their copies' gradients
    a2a_->all_to_all(stage_.data(), dqkv_h_.data(), N * Sa, DType::f32);
    std::fill(dqkv, dqkv + N * S, 0.f);
    for (int r = 0; r < A; ++r) {
      const int64_t kf = kv_first(s, r);
#pragma omp parallel for schedule(static)
      for (int64_t n = 0; n < N; ++n) {
        const float* src = stage_.data() + (r * N + n) * Sa;
        float* dst = dqkv + n * S;
        std::memcpy(dst + r * Ha * D, src, size_t(Ha * D) * sizeof(float));
        for (int64_t j = 0; j < KVa * D; ++j) {
          dst[(s.H + kf) * D + j] += src[Ha * D + j];
          dst[(s.H + s.KV + kf) * D + j] += src[(Ha + KVa) * D + j];
        }
      }
    }
  }
}

}  // namespace origami
