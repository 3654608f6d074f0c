#include "train/balance.h"

#include <algorithm>
#include <numeric>

#include "core/error.h"

namespace origami {

Balance parse_balance(std::string_view name) {
  if (name == "none") return Balance::none;
  if (name == "lpt") return Balance::lpt;
  fail("--balance '", name, "' is not one of none, lpt");
}

const char* balance_name(Balance b) { return b == Balance::none ? "none" : "lpt"; }

double imbalance(const std::vector<double>& cost) {
  const double sum = std::accumulate(cost.begin(), cost.end(), 0.0);
  const double most = cost.empty() ? 0.0 : *std::max_element(cost.begin(), cost.end());
  return sum > 0 ? most * double(cost.size()) / sum : 1.0;
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
  Filling f;
  // Ends: with one row per item every item fits.
  for (int64_t rows = std::max<int64_t>(1, (total + room - 1) / room);
       !lpt(lengths, items, std::vector<int64_t>(workers, rows), row_len, share, load, f); ++rows) {
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
  Filling f = balance == Balance::none
                  ? deal(lengths, items, size_t(ranks), row_len)
                  : lpt_fewest_rows(lengths, items, size_t(ranks), row_len, cost.b, std::vector<double>(size_t(ranks), 0.0));
  Packing p;
  for (const Rows& r : f.rows) p.rows = std::max<int64_t>(p.rows, int64_t(r.size()));
  p.rows = round_up(std::max<int64_t>(1, p.rows), rows_multiple);
  for (Rows& r : f.rows) {
    r.resize(size_t(p.rows));
    p.cost.push_back(cost.a * double(p.rows * row_len) + cost.b * sum_squares(lengths, r));  // padding computes too
    p.ranks.push_back(std::move(r));
  }
  return p;
}

CpPacking pack_sequences_cp(const std::vector<int64_t>& lengths, int groups, int cp, int64_t row_len, int64_t B,
                            int64_t micro_multiple, Balance balance, const SequenceCost& cost) {
  ORIGAMI_ASSERT(groups >= 1 && cp >= 2 && row_len % cp == 0 && B >= 1 && micro_multiple >= 1);
  const int64_t short_len = row_len / cp;
  const size_t ranks = size_t(groups) * size_t(cp);
  std::vector<int32_t> longer, shorter;
  for (size_t i = 0; i < lengths.size(); ++i) (lengths[i] > short_len ? longer : shorter).push_back(int32_t(i));
  // The long sequences over the groups (each rank of a group carries 1/C of their attention).
  const double share = cost.b / double(cp);
  Filling g = balance == Balance::none
                  ? deal(lengths, longer, size_t(groups), row_len)
                  : lpt_fewest_rows(lengths, longer, size_t(groups), row_len, share, std::vector<double>(size_t(groups)));
  CpPacking p;
  for (size_t k = 0; k < size_t(groups); ++k) {  // whole micro-batches of the rows in use
    for (size_t j = g.rows[k].size(); j-- > 0;)
      if (g.rows[k][j].empty()) g.rows[k].erase(g.rows[k].begin() + long(j)), g.free[k].erase(g.free[k].begin() + long(j));
    p.joint.push_back((int64_t(g.rows[k].size()) + B - 1) / B);
    g.rows[k].resize(size_t(p.joint[k] * B));
    g.free[k].resize(size_t(p.joint[k] * B), row_len);
  }
  if (balance == Balance::lpt) shorter = fill_gaps(lengths, shorter, share, g);
  std::vector<double> start(ranks);
  for (size_t w = 0; w < ranks; ++w) start[w] = g.load[w / size_t(cp)];
  // The short ones over every rank, in the micro-batches its group has left of `micro`: dealt, they
  // need what their rows need; under lpt, the fewest that hold them.
  const int64_t least = std::max<int64_t>(1, *std::max_element(p.joint.begin(), p.joint.end()));
  Filling s;
  if (balance == Balance::none) {
    s = deal(lengths, shorter, ranks, short_len);
    int64_t need = least;
    for (size_t w = 0; w < ranks; ++w)
      need = std::max<int64_t>(need, p.joint[w / size_t(cp)] + (int64_t(s.rows[w].size()) + B - 1) / B);
    p.micro = round_up(need, micro_multiple);
  } else {
    for (p.micro = round_up(least, micro_multiple);; p.micro += micro_multiple) {
      std::vector<int64_t> cap(ranks);
      for (size_t w = 0; w < ranks; ++w) cap[w] = (p.micro - p.joint[w / size_t(cp)]) * B;
      if (lpt(lengths, shorter, cap, short_len, cost.b, start, s)) break;
    }
  }
  for (size_t k = 0; k < size_t(groups); ++k) p.groups.push_back(std::move(g.rows[k]));
  for (size_t w = 0; w < ranks; ++w) {
    const size_t k = w / size_t(cp);
    s.rows[w].resize(size_t((p.micro - p.joint[k]) * B));
    const double attention = sum_squares(lengths, p.groups[k]) / double(cp) + sum_squares(lengths, s.rows[w]);
    p.cost.push_back(cost.a * double(p.micro * B * short_len) + cost.b * attention);
    p.ranks.push_back(std::move(s.rows[w]));
  }
  return p;
}

}  // namespace origami
