#include "train/balance.h"

#include <algorithm>
#include <numeric>
#include <tuple>
#include <utility>

#include "core/error.h"

namespace origami {

Balance parse_balance(std::string_view name) {
  if (name == "none") return Balance::none;
  if (name == "lpt") return Balance::lpt;
  if (name == "flex") return Balance::flex;
  fail("--balance '", name, "' is not one of none, lpt, flex");
}

const char* balance_name(Balance b) { return b == Balance::none ? "none" : b == Balance::lpt ? "lpt" : "flex"; }

double imbalance(const std::vector<double>& cost) {
  const double sum = std::accumulate(cost.begin(), cost.end(), 0.0);
  const double most = cost.empty() ? 0.0 : *std::max_element(cost.begin(), cost.end());
  return sum > 0 ? most * double(cost.size()) / sum : 1.0;
}

double imbalance_bound(double common, double b, double mean, double floor) {
  const double avg = common + b * mean;
  return avg > 0 ? (common + b * floor) / avg : 1.0;
}

namespace {

// Workers being filled: each has rows of row_len tokens, at most cap[w] of them (deal opens rows as it
// needs them), and an estimated load (b·n² of what it holds, scaled by `share`).
struct Filling {
  std::vector<Rows> rows;
  std::vector<std::vector<int64_t>> free;
  std::vector<double> load;
};

// Round-robin over workers (items in order), next fit over each worker's rows.
Filling deal(const std::vector<int64_t>& lengths, const std::vector<int32_t>& items, size_t workers, int64_t row_len) {
  Filling f{std::vector<Rows>(workers), std::vector<std::vector<int64_t>>(workers), std::vector<double>(workers, 0.0)};
  for (size_t k = 0; k < items.size(); ++k) {
    const size_t w = k % workers;
    const int64_t n = lengths[size_t(items[k])];
    if (f.rows[w].empty() || f.free[w].back() < n) f.rows[w].emplace_back(), f.free[w].push_back(row_len);
    f.rows[w].back().push_back(items[k]);
    f.free[w].back() -= n;
  }
  return f;
}

// Items longest first (ties in index order).
std::vector<int32_t> longest_first(const std::vector<int64_t>& lengths, std::vector<int32_t> items) {
  std::stable_sort(items.begin(), items.end(), [&](int32_t x, int32_t y) { return lengths[size_t(x)] > lengths[size_t(y)]; });
  return items;
}

// Item i to the least loaded worker with a row it fits in, into that worker's fullest such row (its
// load grows by share·n²); false when no row has room.
bool place(const std::vector<int64_t>& lengths, int32_t i, double share, Filling& f) {
  const int64_t n = lengths[size_t(i)];
  const size_t workers = f.rows.size();
  size_t best = workers, best_row = 0;
  for (size_t w = 0; w < workers; ++w) {
    if (best < workers && f.load[w] >= f.load[best]) continue;
    const std::vector<int64_t>& free = f.free[w];
    size_t row = free.size();
    for (size_t k = 0; k < free.size(); ++k)
      if (free[k] >= n && (row == free.size() || free[k] < free[row])) row = k;
    if (row < free.size()) best = w, best_row = row;
  }
  if (best == workers) return false;
  f.rows[best][best_row].push_back(i);
  f.free[best][best_row] -= n;
  f.load[best] += share * double(n) * double(n);
  return true;
}

// LPT into cap[w] rows per worker, starting from `load`; false when some item finds no room.
bool lpt(const std::vector<int64_t>& lengths, const std::vector<int32_t>& items, const std::vector<int64_t>& cap,
         int64_t row_len, double share, std::vector<double> load, Filling& f) {
  const size_t workers = cap.size();
  f = {std::vector<Rows>(workers), std::vector<std::vector<int64_t>>(workers), std::move(load)};
  for (size_t w = 0; w < workers; ++w) f.rows[w].resize(size_t(cap[w])), f.free[w].assign(size_t(cap[w]), row_len);
  for (const int32_t i : longest_first(lengths, items))
    if (!place(lengths, i, share, f)) return false;
  return true;
}

int64_t tokens_of(const std::vector<int64_t>& lengths, const std::vector<int32_t>& items) {
  int64_t total = 0;
  for (const int32_t i : items) total += lengths[size_t(i)];
  return total;
}

// The fewest rows per worker (uniform) that LPT fits the items into.
Filling lpt_fewest_rows(const std::vector<int64_t>& lengths, const std::vector<int32_t>& items, size_t workers,
                        int64_t row_len, double share, const std::vector<double>& load) {
  const int64_t total = tokens_of(lengths, items), room = int64_t(workers) * row_len;
  // Fewer rows than either bound fit no packing, LPT's or another: the tokens over the room, and the
  // items longer than half a row, no two of which share one (without the second, items all just over
  // half a row tried about half as many row counts as items, each an LPT pass: seconds a step).
  int64_t over_half = 0;
  for (const int32_t i : items) over_half += 2 * lengths[size_t(i)] > row_len;
  const int64_t least = std::max({int64_t(1), (total + room - 1) / room, (over_half + int64_t(workers) - 1) / int64_t(workers)});
  Filling f;
  // Ends: with one row per item every item fits.
  for (int64_t rows = least; !lpt(lengths, items, std::vector<int64_t>(workers, rows), row_len, share, load, f); ++rows) {
  }
  return f;
}

// Short sequences, longest first, into the padding of the groups' rows (it computes anyway, and there a
// sequence costs each rank of the group 1/C of its attention), as LPT places them. Returns those that
// found no room.
std::vector<int32_t> fill_gaps(const std::vector<int64_t>& lengths, const std::vector<int32_t>& items, double share,
                               Filling& g) {
  std::vector<int32_t> rest;
  for (const int32_t i : longest_first(lengths, items))
    if (!place(lengths, i, share, g)) rest.push_back(i);
  return rest;
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

double mean_of(const std::vector<double>& v) {
  return std::accumulate(v.begin(), v.end(), 0.0) / double(std::max<size_t>(1, v.size()));
}

double sum_squares(const std::vector<int64_t>& lengths, const Rows& rows) {
  double s = 0;
  for (const auto& row : rows)
    for (const int32_t i : row) s += double(lengths[size_t(i)]) * double(lengths[size_t(i)]);
  return s;
}

}  // namespace

Packing pack_sequences(const std::vector<int64_t>& lengths, int ranks, int64_t row_len, int64_t rows_multiple,
                       Balance balance, const SequenceCost& cost) {
  ORIGAMI_ASSERT(ranks >= 1 && row_len >= 1 && rows_multiple >= 1);
  std::vector<int32_t> items(lengths.size());
  std::iota(items.begin(), items.end(), 0);
  for (const int64_t n : lengths) ORIGAMI_ASSERT(n >= 1 && n <= row_len);
  const std::vector<double> zero(size_t(ranks), 0.0);
  Filling f = balance == Balance::none ? deal(lengths, items, size_t(ranks), row_len)
                                       : lpt_fewest_rows(lengths, items, size_t(ranks), row_len, 1.0, zero);
  Packing p;
  for (const Rows& r : f.rows) p.rows = std::max<int64_t>(p.rows, int64_t(r.size()));
  const int64_t fewest = p.rows;
  p.rows = round_up(std::max<int64_t>(1, p.rows), rows_multiple);
  // The step runs the rounded-up rows anyway: LPT again with all of them to place into (more room to
  // even the ranks), kept when its busiest rank is lighter.
  Filling wider;
  if (balance != Balance::none && p.rows > fewest &&
      lpt(lengths, items, std::vector<int64_t>(size_t(ranks), p.rows), row_len, 1.0, zero, wider) &&
      *std::max_element(wider.load.begin(), wider.load.end()) < *std::max_element(f.load.begin(), f.load.end()))
    f = std::move(wider);
  double heaviest = 0;
  for (const int64_t n : lengths) heaviest = std::max(heaviest, double(n) * double(n));
  std::vector<double> attention;
  for (Rows& r : f.rows) {
    r.resize(size_t(p.rows));
    attention.push_back(sum_squares(lengths, r));
    p.cost.push_back(cost.a * double(p.rows * row_len) + cost.b * attention.back());  // padding computes too
    p.ranks.push_back(std::move(r));
  }
  const double mean = mean_of(attention);
  p.bound = imbalance_bound(cost.a * double(p.rows * row_len), cost.b, mean, std::max(mean, heaviest));
  return p;
}

namespace {

// Drops a worker's empty rows, then pads them to whole micro-batches of B: its micro-batch count.
int64_t whole_micro_batches(Filling& f, size_t w, int64_t B, int64_t row_len) {
  for (size_t j = f.rows[w].size(); j-- > 0;)
    if (f.rows[w][j].empty()) f.rows[w].erase(f.rows[w].begin() + long(j)), f.free[w].erase(f.free[w].begin() + long(j));
  const int64_t m = (int64_t(f.rows[w].size()) + B - 1) / B;
  f.rows[w].resize(size_t(m * B)), f.free[w].resize(size_t(m * B), row_len);
  return m;
}

// One degree d > 1 of pack_sequences_cp: its sequences over the aligned subgroups of d ranks (rows of
// d·short_len), then (lpt) the shorter ones into their gaps; every rank of a subgroup gets its rows.
void pack_degree(const std::vector<int64_t>& lengths, std::vector<std::vector<int32_t>>& items, size_t level, int d,
                 int64_t short_len, int64_t B, Balance balance, std::vector<double>& load,
                 CpPacking& p) {
  const size_t workers = p.ranks.size() / size_t(d);
  const int64_t len = d * short_len;
  const double share = 1.0 / double(d);  // placement weighs n²/d (balance.h)
  std::vector<double> start(workers);
  for (size_t w = 0; w < workers; ++w)
    start[w] = *std::max_element(load.begin() + long(w) * d, load.begin() + long(w + 1) * d);
  Filling f = balance == Balance::none ? deal(lengths, items[level], workers, len)
                                       : lpt_fewest_rows(lengths, items[level], workers, len, share, start);
  if (balance == Balance::none) f.load = start;
  std::vector<int64_t> micro(workers);
  for (size_t w = 0; w < workers; ++w) micro[w] = whole_micro_batches(f, w, B, len);
  if (balance != Balance::none)
    for (size_t l = level; l-- > 0;) items[l] = fill_gaps(lengths, items[l], share, f);
  for (size_t r = 0; r < p.ranks.size(); ++r) {
    const size_t w = r / size_t(d);
    p.ranks[r].insert(p.ranks[r].end(), f.rows[w].begin(), f.rows[w].end());
    p.degree[r].insert(p.degree[r].end(), size_t(micro[w]), d);
    load[r] += share * sum_squares(lengths, f.rows[w]);
  }
}

// Degree 1 of pack_sequences_cp: the rest over every rank in rows of short_len, in the micro-batches it
// has left of p.micro: dealt, they take what their rows need; under lpt, the fewest that hold them.
void pack_alone(const std::vector<int64_t>& lengths, const std::vector<int32_t>& items, int64_t short_len, int64_t B,
                int64_t micro_multiple, Balance balance, const std::vector<double>& load,
                CpPacking& p) {
  const size_t ranks = p.ranks.size();
  int64_t least = 1;
  for (const auto& d : p.degree) least = std::max<int64_t>(least, int64_t(d.size()));
  Filling s;
  if (balance == Balance::none) {
    s = deal(lengths, items, ranks, short_len);
    for (size_t r = 0; r < ranks; ++r)
      least = std::max<int64_t>(least, int64_t(p.degree[r].size()) + (int64_t(s.rows[r].size()) + B - 1) / B);
    p.micro = round_up(least, micro_multiple);
  } else {
    for (p.micro = round_up(least, micro_multiple);; p.micro += micro_multiple) {
      std::vector<int64_t> cap(ranks);
      for (size_t r = 0; r < ranks; ++r) cap[r] = (p.micro - int64_t(p.degree[r].size())) * B;
      if (lpt(lengths, items, cap, short_len, 1.0, load, s)) break;
    }
  }
  for (size_t r = 0; r < ranks; ++r) {
    s.rows[r].resize(size_t((p.micro - int64_t(p.degree[r].size())) * B));
    p.ranks[r].insert(p.ranks[r].end(), s.rows[r].begin(), s.rows[r].end());
    p.degree[r].resize(size_t(p.micro), 1);
  }
}

// pack_sequences_cp with sequence i at degree degrees[level[i]] (or, balanced, in a larger degree's gap).
CpPacking pack_at_levels(const std::vector<int64_t>& lengths, const std::vector<size_t>& level, int groups, int cp,
                         int64_t row_len, int64_t B, int64_t micro_multiple, Balance balance, const SequenceCost& cost) {
  const int64_t short_len = row_len / cp;
  const std::vector<int> degrees = cp_degrees(cp);
  std::vector<std::vector<int32_t>> items(degrees.size());
  for (size_t i = 0; i < lengths.size(); ++i) items[level[i]].push_back(int32_t(i));
  CpPacking p;
  const size_t ranks = size_t(groups) * size_t(cp);
  p.ranks.resize(ranks), p.degree.resize(ranks);
  std::vector<double> load(ranks, 0.0);  // n²/d per rank so far
  for (size_t l = degrees.size(); l-- > 1;)
    pack_degree(lengths, items, l, degrees[l], short_len, B, balance, load, p);
  pack_alone(lengths, items[0], short_len, B, micro_multiple, balance, load, p);
  p.sequences.assign(degrees.size(), 0);
  double heaviest = 0;
  for (size_t r = 0; r < ranks; ++r) {
    double attention = 0;
    for (int64_t m = 0; m < p.micro; ++m) {
      const int d = p.degree[r][size_t(m)];
      const size_t at = size_t(std::find(degrees.begin(), degrees.end(), d) - degrees.begin());
      for (int64_t b = 0; b < B; ++b)
        for (const int32_t i : p.ranks[r][size_t(m * B + b)]) {
          const double n = double(lengths[size_t(i)]);
          attention += n * n / double(d);
          heaviest = std::max(heaviest, n * n / double(cp));
          if (r % size_t(d) == 0) ++p.sequences[at];  // once per subgroup
        }
    }
    p.attention.push_back(attention);
    p.cost.push_back(cost.a * double(p.micro * B * short_len) + cost.b * attention);
  }
  const double mean = mean_of(p.attention);
  p.floor = std::max(mean, heaviest);
  p.bound = imbalance_bound(cost.a * double(p.micro * B * short_len), cost.b, mean, p.floor);
  return p;
}

double busiest(const CpPacking& p) { return *std::max_element(p.attention.begin(), p.attention.end()); }

// A raise is kept when its packing p is no worse than q by `weigh`'s estimate of the busiest rank (a
// micro-batch saved, on every rank, against attention added) and not in micro-batches, and better in
// one of them: fewer micro-batches, or a busiest rank lighter by at least `gain` (a raise moves a
// sequence onto CP exchanges, which the estimate does not count, so it must pay for them). The sums
// are computed alike on every rank (the same lengths in the same order), so every rank decides alike.
constexpr double gain = 0.01;
bool better(const CpPacking& p, const CpPacking& q, int64_t row_tokens, const SequenceCost& weigh) {
  auto estimate = [&](const CpPacking& x) { return weigh.a * double(x.micro * row_tokens) + weigh.b * busiest(x); };
  return p.micro <= q.micro && estimate(p) <= estimate(q) &&
         (p.micro < q.micro || busiest(p) <= (1 - gain) * busiest(q));
}

// The sequences below the top degree on rank `only` of p (every rank: only = p.ranks.size()), the
// heaviest share n²/d first (ties in index order), at most `most` of them, each with the level one
// above the degree it ran at (a short sequence may have run in a larger degree's gap).
std::vector<std::pair<int32_t, size_t>> raisable(const CpPacking& p, const std::vector<int64_t>& lengths,
                                                 const std::vector<int>& degrees, int64_t B, size_t only, size_t most) {
  std::vector<std::tuple<double, int32_t, size_t>> items;  // (−n²/d, index, level up)
  const bool every = only == p.ranks.size();
  for (size_t k = every ? 0 : only; k < (every ? p.ranks.size() : only + 1); ++k)
    for (size_t r = 0; r < p.ranks[k].size(); ++r) {
      const int d = p.degree[k][r / size_t(B)];
      const size_t at = size_t(std::find(degrees.begin(), degrees.end(), d) - degrees.begin());
      if (at + 1 < degrees.size() && (k == only || k % size_t(d) == 0))  // each sequence once
        for (const int32_t i : p.ranks[k][r])
          items.emplace_back(-double(lengths[size_t(i)]) * double(lengths[size_t(i)]) / d, i, at + 1);
    }
  std::sort(items.begin(), items.end());
  std::vector<std::pair<int32_t, size_t>> out;
  for (size_t k = 0; k < std::min(most, items.size()); ++k) out.emplace_back(std::get<1>(items[k]), std::get<2>(items[k]));
  return out;
}

}  // namespace

// flex: from the least degrees (lpt's packing), the busiest rank's heaviest sequences (and, while the
// step may fit in fewer micro-batches, the heaviest of all) are tried one degree up, the first that
// makes the packing better (`better`) kept, for at most `rounds` rounds of at most 2·`tries`
// repackings each, and no more once the busiest rank is within `gain` of its floor (CpPacking::floor)
// in the fewest micro-batches that hold the step's tokens. A sequence one degree up splits its
// attention over twice the ranks; its row is longer, so it may fill a gap there or need a micro-batch
// more (then it is not kept).
CpPacking pack_sequences_cp(const std::vector<int64_t>& lengths, int groups, int cp, int64_t row_len, int64_t B,
                            int64_t micro_multiple, Balance balance, const SequenceCost& cost, const SequenceCost& weigh) {
  ORIGAMI_ASSERT(groups >= 1 && cp >= 2 && row_len % cp == 0 && B >= 1 && micro_multiple >= 1);
  const int64_t short_len = row_len / cp;
  const std::vector<int> degrees = cp_degrees(cp);
  std::vector<size_t> level(lengths.size(), 0);  // each sequence at the least degree whose rows hold it
  for (size_t i = 0; i < lengths.size(); ++i) {
    ORIGAMI_ASSERT(lengths[i] >= 1 && lengths[i] <= row_len);  // (pieces of at most L: the top degree holds it)
    while (lengths[i] > degrees[level[i]] * short_len) ++level[i];
  }
  auto pack = [&] { return pack_at_levels(lengths, level, groups, cp, row_len, B, micro_multiple, balance, cost); };
  CpPacking best = pack();
  if (balance != Balance::flex) return best;
  const int64_t room = int64_t(best.ranks.size()) * B * short_len;  // tokens a micro-batch holds over all ranks
  const int64_t fewest = round_up(std::max<int64_t>(1, (std::accumulate(lengths.begin(), lengths.end(), int64_t(0)) +
                                                        room - 1) / room), micro_multiple);
  auto may_gain = [&] { return busiest(best) > (1 + gain) * best.floor || best.micro > fewest; };
  const size_t tries = 4, rounds = 16;
  bool raised = true;
  for (size_t round = 0; raised && round < rounds && may_gain(); ++round) {
    raised = false;
    // The busiest rank's heaviest; while the step may fit fewer micro-batches, also the heaviest of all.
    const size_t top = size_t(std::max_element(best.attention.begin(), best.attention.end()) - best.attention.begin());
    auto items = raisable(best, lengths, degrees, B, top, tries);
    if (best.micro > fewest)
      for (const auto& item : raisable(best, lengths, degrees, B, best.ranks.size(), tries))
        if (std::find(items.begin(), items.end(), item) == items.end()) items.push_back(item);
    for (size_t k = 0; k < items.size() && !raised; ++k) {
      const auto [i, up] = items[k];
      const size_t was = std::exchange(level[size_t(i)], up);
      CpPacking p = pack();
      if ((raised = better(p, best, B * short_len, weigh))) best = std::move(p);
      else level[size_t(i)] = was;
    }
  }
  return best;
}

}  // namespace origami
