#include "parallel/data_parallel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>


#include "core/error.h"
#include "core/memory.h"
#include "kernels/cpu/optimizer.h"
#include "kernels/cpu/parallel.h"

namespace origami {

namespace {

// FSSDP: calls fn(begin, end) for the parts of block j of x inside `shards` (one rank's shards).
template <typename Fn>
void pieces_in(const ExpertBlocks& x, int64_t j, const std::vector<Range>& shards, Fn&& fn) {
  const Range e = x.of(j);
  for (const Range& s : shards)
    if (std::max(e.begin, s.begin) < std::min(e.end, s.end)) fn(std::max(e.begin, s.begin), std::min(e.end, s.end));
}

}  // namespace

DataParallel::DataParallel(Params& params, Comm& dp, Comm& tp, int zero_stage, bool sequence_parallel, Comm* embedding,
                           DType wire, bool sparse, bool keep, bool bf16, const std::vector<LayerRange>& chunks)
    : params_(params), dp_(dp), tp_(tp), embedding_(embedding), zero_(zero_stage),
      sp_(sequence_parallel && tp.size() > 1), wire_(dp.size() > 1 ? wire : DType::f32), sparse_(sparse),
      keep_(sparse && keep), stage_bf16_(sparse && bf16) {
  ORIGAMI_CHECK(zero_ >= 0 && zero_ <= 3, "--zero must be 0, 1, 2 or 3, got ", zero_);
  ORIGAMI_ASSERT(wire == DType::f32 || wire == DType::bf16);
  ORIGAMI_ASSERT(params.layout().dp == dp.size() && (!sparse || zero_ == 3));
  shards_ = bucket_shards(params.buckets(), dp.size(), dp.rank());
  if (sparse)
    for (int r = 0; r < dp.size(); ++r) rank_shards_.push_back(bucket_shards(params.buckets(), dp.size(), r));
  owned_ = zero_ == 0 ? std::vector<Range>{{0, params.size()}} : shards_;
  if (zero_ == 3) params.hold_only(shards_);  // from the start: an init or a load fills the shards alone
  std::vector<Range> unread;  // ZeRO 1/2: the copy buckets' values outside the shard (drop_values)
  for (size_t b = 0; b < shards_.size() && (zero_ == 1 || zero_ == 2); ++b)
    if (params.copy_bucket(b)) {
      const std::array<Range, 2> outside = outside_shard(b);
      unread.insert(unread.end(), outside.begin(), outside.end());
    }
  params.unread_after_copy(std::move(unread));
  // The bf16 copy the update writes: all it updates where that is every value (ZeRO 0, or one rank),
  // else the copy buckets' shards, which their gathers send as they are. The other buckets' copies
  // are rounded from the gathered values (gather_params, use_weights).
  if (zero_ < 3 && (zero_ == 0 || dp.size() == 1)) copy_from_update_ = owned_;
  else
    for (size_t b = 0; b < shards_.size(); ++b)
      if (params.copy_bucket(b)) copy_from_update_.push_back(shards_[b]);
  if (wire_ == DType::bf16 && !sparse) low_ = ReleasablePages(2 * params.size(), "the bf16 gradient reduction buffer");
  pending_.resize(params.buckets().size());
  gathers_.resize(params.buckets().size());
  held_.assign(params.buckets().size(), 0);
  gathered_.assign(params.buckets().size(), 0);
  started_.assign(params.buckets().size(), kIdle);
  if (zero_ >= 2 && !sparse && chunks.size() > 1)
    pass_buckets_ = pass_buckets(params.table(), params.offsets(), params.layout().tp, params.buckets(), chunks);
  const std::vector<ParamSpec>& table = params.table();
  for (const Segment& seg : params.segments(owned_)) {
    const TpSplit& split = table[seg.param].split;
    if ((sp_ && split.seq_partial) || (tp.size() > 1 && split.token_partial)) partial_segs_.push_back(seg);
  }
  for (size_t b = 0; b < params.buckets().size(); ++b)
    for (const Segment& seg : params.segments({params.buckets()[b]}))
      if (table[seg.param].pp_shared) {
        ORIGAMI_ASSERT(embedding_ != nullptr && embedding_->size() == 2);
        shared_buckets_.push_back(b);
        break;
      }
  for (const Segment& seg : params.segments(shards_)) {
    const bool tp_counted = table[seg.param].split.dim >= 0 || tp.rank() == 0;
    const bool pp_counted = !table[seg.param].pp_shared || embedding_->rank() == 0;
    // Checked but not counted: TP replicas. (The tied embedding's copy on the last stage equals the
    // first stage's after the embedding all-reduce, which counts it.)
    if (tp_counted && pp_counted) norm_segs_.push_back(seg);
    else if (!tp_counted) copy_segs_.push_back(seg);
  }
}

std::vector<Range> bucket_shards(const std::vector<Range>& buckets, int dp, int dp_rank) {
  std::vector<Range> out;
  for (const Range& b : buckets) {
    const int64_t n = (b.end - b.begin) / dp;
    out.push_back({b.begin + dp_rank * n, b.begin + (dp_rank + 1) * n});
  }
  return out;
}

void DataParallel::begin_step() {
  traffic_ = {};
  for (auto& [begin, kept] : kept_) std::fill(kept.begin(), kept.end(), 0);  // values loaded or changed since
  if (sparse_) {  // FSSDP writes gradients to the shards only: clearing them keeps their pages
#pragma omp parallel
    for (const Range& s : shards_) {  // as Params::zero_grad, each thread its share of each shard
      const Share mine = my_share(s.end - s.begin);
      zero_streaming(params_.grad() + s.begin + mine.begin, mine.end - mine.begin);
    }
  } else if (zero_ >= 2) {
    params_.release_grad();  // the shards accumulate from zero; nothing else is resident
  } else {
    params_.zero_grad();
  }
  // Only the shards of the values are kept (the full buffer after an init or a load, whose bf16 copy
  // has been made): ZeRO-3's, and ZeRO 1/2's of the copy buckets, whose other values are never read.
  for (size_t b = 0; b < gathered_.size(); ++b) {
    if (zero_ == 3) {
      ORIGAMI_ASSERT(held_[b] == 0 && !gathers_[b].pending());
      drop_values(b, true);
    } else if (zero_ > 0 && params_.copy_bucket(b)) {
      drop_values(b, false);
    }
  }
  std::fill(started_.begin(), started_.end(), kIdle);
}

std::vector<std::vector<char>> pass_buckets(const std::vector<ParamSpec>& table, const std::vector<int64_t>& offsets,
                                            int tp, const std::vector<Range>& buckets,
                                            const std::vector<LayerRange>& chunks) {
  std::vector<std::vector<char>> out(chunks.size(), std::vector<char>(buckets.size(), 0));
  for (size_t i = 0; i < table.size(); ++i) {
    const int64_t unit = param_unit(table[i].name);
    const Range t{offsets[i], offsets[i] + table[i].local_numel(tp)};
    // The buckets are listed from the end of the buffer: those from the first beginning before t ends.
    const auto first = std::partition_point(buckets.begin(), buckets.end(), [&](const Range& b) { return b.begin >= t.end; });
    for (size_t c = 0; c < chunks.size(); ++c) {
      if (unit >= 0 && (unit < chunks[c].begin || unit >= chunks[c].end)) continue;
      for (auto b = first; b != buckets.end() && b->end > t.begin; ++b) out[c][size_t(b - buckets.begin())] = 1;
    }
  }
  return out;
}

void DataParallel::begin_backward(bool final, int chunk) {
  if (zero_ >= 2)  // the pass's buckets; the others' (none written) wait for their own chunk's pass
    for (size_t b = 0; b < started_.size(); ++b)
      started_[b] = pass_buckets_.empty() || pass_buckets_[size_t(chunk)][b] ? kIdle : kDone;
  armed_ = !sparse_ && (zero_ >= 2 || final);  // FSSDP reduces in reduce_experts
}

// Bucket b (elements r) is reduced in place. ZeRO 0 all-reduces it. ZeRO ≥ 1 reduce-scatters it: the
// result, this rank's shard s, lands at r.begin and complete_bucket moves it to s. Under ZeRO-2, s holds
// the shard accumulated over the earlier passes plus this pass's gradients (backward adds to it), so
// the reduction yields the new accumulated shard in fp32. With a bf16 wire the bucket is rounded into
// low_ and, under ZeRO ≥ 1, this rank's own block there is zeroed: it never travels, so it is not
// rounded; the others' sum is widened and added to s in fp32.
void DataParallel::start_bucket(size_t b) {
  if (zero_ >= 2)  // one reduction in flight at most: two buckets resident beside the shards
    for (size_t p = 0; p < started_.size(); ++p)
      if (started_[p] == kInFlight) complete_bucket(p);
  const Range& r = params_.buckets()[b];
  const int64_t n = r.end - r.begin, shard = shards_[b].end - shards_[b].begin;
  void* buf = params_.grad() + r.begin;
  if (wire_ == DType::bf16) {
    bf16* low = static_cast<bf16*>(low_.data()) + r.begin;
    round_to_bf16(low, params_.grad() + r.begin, n);
    if (zero_ >= 1) std::fill_n(low + (shards_[b].begin - r.begin), shard, bf16{0});
    buf = low;
  }
  const double before = dp_.bytes_sent();
  if (zero_ == 0) pending_[b] = dp_.iall_reduce(buf, n, wire_, ReduceOp::sum);
  else pending_[b] = dp_.ireduce_scatter(buf, buf, shard, wire_, ReduceOp::sum);
  traffic_.reduced_bytes += dp_.bytes_sent() - before;
  started_[b] = kInFlight;
}

void DataParallel::grads_ready(int64_t offset) {
  if (!armed_) return;
  const std::vector<Range>& buckets = params_.buckets();
  for (size_t b = 0; b < buckets.size(); ++b)
    if (started_[b] == kIdle && buckets[b].begin >= offset) start_bucket(b);
  // Drive the reductions in flight; those done are completed now (ZeRO-2 returns their pages early).
  for (size_t b = 0; b < buckets.size(); ++b)
    if (started_[b] == kInFlight && pending_[b].test()) complete_bucket(b);
}

void DataParallel::complete_bucket(size_t b) {
  pending_[b].wait();
  started_[b] = kDone;
  const Range &r = params_.buckets()[b], &s = shards_[b];
  float* g = params_.grad();
  if (wire_ == DType::bf16) {
    const bf16* low = static_cast<const bf16*>(low_.data()) + r.begin;
    if (zero_ == 0) widen_to_float(g + r.begin, low, r.end - r.begin);
    else
#pragma omp parallel for simd schedule(static)
      for (int64_t i = 0; i < s.end - s.begin; ++i) g[s.begin + i] += to_float(low[i]);
    low_.release(2 * r.begin, 2 * r.end);
  } else if (zero_ >= 1 && s.begin != r.begin) {
    std::memmove(g + s.begin, g + r.begin, size_t(s.end - s.begin) * sizeof(float));
  }
  if (zero_ >= 2) {  // keep only the shard
    params_.release_grad({r.begin, s.begin});
    params_.release_grad({s.end, r.end});
  }
}

void DataParallel::end_backward() {
  if (zero_ >= 2 && !sparse_) {
    grads_ready(0);  // every bucket, in case backward did not announce them all
    for (size_t b = 0; b < started_.size(); ++b)
      if (started_[b] == kInFlight) complete_bucket(b);
  }
  armed_ = false;
}

double DataParallel::complete_gradients() {
  float* g = params_.grad();
  for (size_t b = 0; b < started_.size() && !sparse_; ++b) {  // ZeRO-2 completed every bucket in end_backward
    if (started_[b] == kIdle) start_bucket(b);      // buckets backward did not announce (a tied embedding on the last stage)
    if (started_[b] == kInFlight) complete_bucket(b);
  }
  // The tied embedding: its bucket (ZeRO 0) or this rank's shard of it, summed over the first and last stage.
  for (size_t b : shared_buckets_) {
    const Range r = zero_ == 0 ? params_.buckets()[b] : shards_[b];
    embedding_->all_reduce(g + r.begin, r.end - r.begin);
  }
  // TP-partial gradients: norm weights under SP (sequence shards), the MoE router (token shares).
  if (!partial_segs_.empty()) {
    std::vector<float> packed;
    for (const Segment& s : partial_segs_) packed.insert(packed.end(), g + s.begin, g + s.end);
    tp_.all_reduce(packed.data(), int64_t(packed.size()));
    size_t at = 0;
    for (const Segment& s : partial_segs_) {
      std::memcpy(g + s.begin, packed.data() + at, size_t(s.end - s.begin) * sizeof(float));
      at += size_t(s.end - s.begin);
    }
  }
  // Global norm: each element once over DP (this rank's shard) and TP (replicated tensors on TP rank 0).
  // One parallel region for all segments (as in AdamW::step); each thread sums its share of each.
  // The copies not counted are summed too, only to find a non-finite element.
  auto sum_squares = [g](const std::vector<Segment>& segs) {
    double sq = 0;
#pragma omp parallel reduction(+ : sq)
    {
      for (const Segment& s : segs) {
        const Share mine = my_share(s.end - s.begin);
        sq += origami::sum_squares(g + s.begin + mine.begin, mine.end - mine.begin);
      }
    }
    return sq;
  };
  if (!std::isfinite(sum_squares(copy_segs_))) return std::numeric_limits<double>::quiet_NaN();
  return sum_squares(norm_segs_);
}

Gradients finish_gradients(const std::vector<DataParallel*>& sets, Comm& world, double local_loss) {
  double red[2] = {0.0, std::isfinite(local_loss) ? 0.0 : 1.0};
  for (DataParallel* set : sets) red[0] += set->complete_gradients();
  world.all_reduce(red, 2);
  return {std::sqrt(red[0]), red[1] == 0};
}

void DataParallel::gather_params() {
  for (auto& [begin, kept] : kept_) std::fill(kept.begin(), kept.end(), 0);  // the values were just updated
  // The update wrote the bf16 copy of copy_from_update_ (every value here, or the copy buckets' shards).
  if (zero_ == 3 || zero_ == 0 || dp_.size() == 1) return;
  for (size_t b = 0; b < shards_.size(); ++b) pending_[b] = all_gather_bucket(b);
  for (size_t b = 0; b < shards_.size(); ++b) {
    pending_[b].wait();
    if (!params_.copy_bucket(b)) params_.refresh_bf16_copy(params_.buckets()[b]);
  }
}

std::vector<size_t> DataParallel::buckets_of(const std::vector<Range>& unit) const {
  std::vector<size_t> out;
  const std::vector<Range>& buckets = params_.buckets();
  for (size_t b = 0; b < buckets.size(); ++b)
    for (const Range& r : unit)
      if (r.begin < buckets[b].end && buckets[b].begin < r.end) {
        out.push_back(b);
        break;
      }
  return out;
}

Request DataParallel::all_gather_bucket(size_t b) {
  const Range &r = params_.buckets()[b], &s = shards_[b];
  const double before = dp_.bytes_sent();
  Request out;
  if (params_.copy_bucket(b)) {  // GEMM weights under bf16: their copy alone, the shard's kept current
    bf16* low = params_.bf16_copy();
    out = dp_.iall_gather(low + r.begin, low + s.begin, s.end - s.begin, DType::bf16);
  } else {
    float* w = params_.data();
    out = dp_.iall_gather(w + r.begin, w + s.begin, s.end - s.begin, DType::f32);
  }
  traffic_.gathered_bytes += dp_.bytes_sent() - before;
  return out;
}

void DataParallel::start_gather(size_t b) {
  if (!gathered_[b] && !gathers_[b].pending()) gathers_[b] = all_gather_bucket(b);
}

std::array<Range, 2> DataParallel::outside_shard(size_t b) const {
  const Range &r = params_.buckets()[b], &s = shards_[b];
  return {Range{r.begin, s.begin}, Range{s.end, r.end}};
}

void DataParallel::drop_values(size_t b, bool with_copy) {
  // A copy bucket keeps its shard's copy (what its gathers send); another's copy is made when it is gathered.
  const Range& r = params_.buckets()[b];
  const Range none{r.end, r.end};
  const auto [before, after] = outside_shard(b);
  const bool copy = params_.copy_bucket(b);
  params_.release_values(before, !with_copy ? none : copy ? before : r);
  params_.release_values(after, with_copy && copy ? after : none);
  gathered_[b] = 0;
}

void DataParallel::use_weights(WeightUse use, const std::vector<Range>& unit) {
  if (zero_ != 3 || sparse_ || unit.empty()) return;  // FSSDP: gather_experts
  std::vector<int64_t> key;  // a unit's buckets never change: found once
  for (const Range& r : unit) key.push_back(r.begin), key.push_back(r.end);
  auto known = unit_buckets_.find(key);
  if (known == unit_buckets_.end()) known = unit_buckets_.emplace(std::move(key), buckets_of(unit)).first;
  const std::vector<size_t>& buckets = known->second;
  switch (use) {
    case WeightUse::prefetch:
      for (size_t b : buckets) start_gather(b);
      break;
    case WeightUse::need:
      for (size_t b : buckets) start_gather(b), ++held_[b];
      for (size_t b : buckets)
        if (!gathered_[b]) {
          gathers_[b].wait();
          gathers_[b] = Request();
          if (!params_.copy_bucket(b))  // bf16: the GEMMs' copy of the gathered values
            params_.refresh_bf16_copy(params_.buckets()[b]);
          gathered_[b] = 1;
        }
      break;
    case WeightUse::done:
      for (size_t b : buckets) {
        ORIGAMI_ASSERT(held_[b] > 0);
        if (--held_[b] == 0) drop_values(b, true);
      }
      break;
  }
}

template <typename Fn>
void DataParallel::sparse_walk(const ExpertBlocks& x, bool to_owners, Fn&& fn) const {
  const int me = dp_.rank();
  for (int r = 0; r < dp_.size(); ++r) {
    if (r == me) continue;
    const int32_t* need = needs_.data() + (to_owners ? me : r) * x.count;  // whose blocks
    const std::vector<Range>& shards = rank_shards_[size_t(to_owners ? r : me)];  // held by whom
    for (int64_t j = 0; j < x.count; ++j)
      if (need[j]) pieces_in(x, j, shards, [&](int64_t lo, int64_t hi) { fn(r, lo, hi); });
  }
}

std::vector<std::pair<int, Range>> DataParallel::sparse_runs(const ExpertBlocks& x, bool to_owners) const {
  std::vector<std::pair<int, Range>> out;
  sparse_walk(x, to_owners, [&](int r, int64_t lo, int64_t hi) {
    if (!out.empty() && out.back().first == r && out.back().second.end == lo) out.back().second.end = hi;
    else out.push_back({r, {lo, hi}});
  });
  return out;
}

template <typename T, typename Src, typename Dst, typename Done>
double DataParallel::sparse_exchange(const ExpertBlocks& x, bool to_owners, Src&& src, Dst&& dst, Done&& done) {
  constexpr int kTag = 0;  // a pair's messages match in the order both walk them
  const DType t = std::is_same_v<T, bf16> ? DType::bf16 : DType::f32;
  const std::vector<std::pair<int, Range>> sends = sparse_runs(x, to_owners), recvs = sparse_runs(x, !to_owners);
  auto total = [](const std::vector<std::pair<int, Range>>& runs) {
    int64_t n = 0;
    for (const auto& [r, run] : runs) n += run.end - run.begin;
    return size_t(n);
  };
  constexpr bool convert_sends = std::is_same_v<T, bf16>;  // (see the declaration)
  const bool land_in_scratch = to_owners;
  if (convert_sends && scratch_out_.size() < total(sends) * sizeof(T)) scratch_out_.resize(total(sends) * sizeof(T));
  if (land_in_scratch && scratch_in_.size() < total(recvs) * sizeof(T)) scratch_in_.resize(total(recvs) * sizeof(T));
  // Each run's scratch: at its offset into the run list's elements, or null where there is none.
  auto scratch_at = [](std::vector<char>& bytes, bool used, int64_t offset) {
    return used ? reinterpret_cast<T*>(bytes.data()) + offset : nullptr;
  };
  std::vector<Request> pending;
  std::vector<T*> landed;
  int64_t offset = 0;
  for (const auto& [r, run] : recvs) {  // every receive is posted before any send
    landed.push_back(dst(run.begin, run.end, scratch_at(scratch_in_, land_in_scratch, offset)));
    pending.push_back(dp_.irecv(landed.back(), run.end - run.begin, t, r, kTag));
    offset += run.end - run.begin;
  }
  const double before = dp_.bytes_sent();
  offset = 0;
  for (const auto& [r, run] : sends) {
    pending.push_back(dp_.isend(src(run.begin, run.end, scratch_at(scratch_out_, convert_sends, offset)),
                                run.end - run.begin, t, r, kTag));
    offset += run.end - run.begin;
  }
  for (Request& q : pending) q.wait();
  for (size_t i = 0; i < recvs.size(); ++i) done(recvs[i].second.begin, recvs[i].second.end, landed[i]);
  return dp_.bytes_sent() - before;
}

template <typename Fn>
void DataParallel::own_pieces(const ExpertBlocks& x, const std::vector<int32_t>& need, Fn&& fn) const {
  for (int64_t j = 0; j < x.count; ++j)
    if (need[size_t(j)]) pieces_in(x, j, shards_, fn);
}

void DataParallel::exchange_needs(const std::vector<int32_t>& need) {
  needs_.resize(size_t(dp_.size()) * need.size());
  dp_.all_gather(needs_.data(), need.data(), int64_t(need.size()), DType::i32);
}

ExpertPlace DataParallel::gather_experts(const ExpertBlocks& x, const std::vector<int32_t>& need) {
  ORIGAMI_ASSERT(sparse_ && int64_t(need.size()) == x.count);
  std::vector<int32_t> want = need;  // under keep, a block staged earlier in the step is still valid
  std::vector<int32_t>* kept = keep_ ? &kept_[x.begin] : nullptr;
  if (kept) {
    kept->resize(size_t(x.count), 0);
    for (int64_t j = 0; j < x.count; ++j) want[size_t(j)] &= !(*kept)[size_t(j)];
  }
  exchange_needs(want);
  for (int64_t j = 0; j < x.count; ++j) {
    traffic_.expert_gathers += want[size_t(j)] != 0;
    if (kept) (*kept)[size_t(j)] |= want[size_t(j)];
  }
  if (stage_grads_.size() < size_t(x.count * x.block)) stage_grads_.resize(size_t(x.count * x.block));
  // The values' staging area: one layer's (staged positions relative to its first block) or, under
  // keep, the whole buffer's (absolute positions).
  const int64_t at = keep_ ? 0 : x.begin;
  const size_t floats = size_t(keep_ ? params_.size() : x.count * x.block);
  const float* w = params_.data();
  if (!stage_bf16_) {
    if (stage_values_.size() < floats) stage_values_.resize(floats);
    float* v = stage_values_.data();  // position lo is staged at v + (lo - at)
    own_pieces(x, want, [&](int64_t lo, int64_t hi) { std::memcpy(v + (lo - at), w + lo, size_t(hi - lo) * sizeof(float)); });
    traffic_.gathered_bytes += sparse_exchange<float>(
        x, false, [w](int64_t lo, int64_t, float*) { return w + lo; },
        [v, at](int64_t lo, int64_t, float*) { return v + (lo - at); }, [](int64_t, int64_t, const float*) {});
    return {v + (x.begin - at), nullptr, stage_grads_.data()};
  }
  // bf16 GEMMs read only the copy: the pieces travel as bf16 into it, this rank's own rounded from its shard.
  if (stage_low_.size() < floats) stage_low_.resize(floats);
  bf16* low = stage_low_.data();  // position lo is staged at low + (lo - at)
  own_pieces(x, want, [&](int64_t lo, int64_t hi) { round_to_bf16(low + (lo - at), w + lo, hi - lo); });
  traffic_.gathered_bytes += sparse_exchange<bf16>(
      x, false,
      [w](int64_t lo, int64_t hi, bf16* scratch) {
        round_to_bf16(scratch, w + lo, hi - lo);
        return scratch;
      },
      [low, at](int64_t lo, int64_t, bf16*) { return low + (lo - at); }, [](int64_t, int64_t, const bf16*) {});
  return {nullptr, low + (x.begin - at), stage_grads_.data()};
}

void DataParallel::reduce_experts(const ExpertBlocks& x, const std::vector<int32_t>& need) {
  ORIGAMI_ASSERT(sparse_ && int64_t(need.size()) == x.count);
  exchange_needs(need);
  float* g = params_.grad();
  const float* staged = stage_grads_.data();  // position lo's gradient is at staged + (lo - begin)
  const int64_t begin = x.begin;
  auto add = [g](int64_t lo, int64_t hi, const float* in) {
#pragma omp simd
    for (int64_t i = 0; i < hi - lo; ++i) g[lo + i] += in[i];
  };
  own_pieces(x, need, [&](int64_t lo, int64_t hi) { add(lo, hi, staged + (lo - begin)); });
  auto land = [](int64_t, int64_t, auto* scratch) { return scratch; };  // received pieces are added
  if (wire_ == DType::bf16) {
    traffic_.reduced_bytes += sparse_exchange<bf16>(
        x, true,
        [staged, begin](int64_t lo, int64_t hi, bf16* scratch) {
          round_to_bf16(scratch, staged + (lo - begin), hi - lo);
          return scratch;
        },
        land,
        [g](int64_t lo, int64_t hi, const bf16* in) {
          for (int64_t i = 0; i < hi - lo; ++i) g[lo + i] += to_float(in[i]);
        });
  } else {
    traffic_.reduced_bytes += sparse_exchange<float>(
        x, true, [staged, begin](int64_t lo, int64_t, float*) { return staged + (lo - begin); }, land, add);
  }
  for (int64_t j = 0; j < x.count; ++j)  // the staged gradients start from zero at the next backward
    if (need[size_t(j)]) std::fill_n(stage_grads_.data() + j * x.block, x.block, 0.f);
}

}  // namespace origami
