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

double Packing::imbalance() const {
  const double sum = std::accumulate(cost.begin(), cost.end(), 0.0);
  const double most = cost.empty() ? 0.0 : *std::max_element(cost.begin(), cost.end());
  return sum > 0 ? most * double(cost.size()) / sum : 1.0;
}

namespace {

struct Filling {  // rows being filled: their sequences and free tokens
  std::vector<std::vector<int32_t>> rows;
  std::vector<int64_t> free;
};

// Round-robin over ranks, next fit over each rank's rows.
std::vector<Filling> deal(const std::vector<int64_t>& lengths, int ranks, int64_t row_len) {
  std::vector<Filling> out(static_cast<size_t>(ranks));
  for (size_t i = 0; i < lengths.size(); ++i) {
    Filling& f = out[i % size_t(ranks)];
    if (f.rows.empty() || f.free.back() < lengths[i]) f.rows.emplace_back(), f.free.push_back(row_len);
    f.rows.back().push_back(int32_t(i));
    f.free.back() -= lengths[i];
  }
  return out;
}

// LPT into `rows` rows per rank; false when some sequence finds no room.
bool lpt(const std::vector<int64_t>& lengths, int ranks, int64_t row_len, int64_t rows, const SequenceCost& cost,
         std::vector<Filling>& out) {
  out.assign(size_t(ranks), Filling{std::vector<std::vector<int32_t>>(size_t(rows)),
                                    std::vector<int64_t>(size_t(rows), row_len)});
  std::vector<int32_t> order(lengths.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t x, int32_t y) { return lengths[size_t(x)] > lengths[size_t(y)]; });
  std::vector<double> load(size_t(ranks), 0.0);
  for (const int32_t i : order) {
    const int64_t n = lengths[size_t(i)];
    int best_rank = -1;
    size_t best_row = 0;
    for (int r = 0; r < ranks; ++r) {
      if (best_rank >= 0 && load[size_t(r)] >= load[size_t(best_rank)]) continue;
      const std::vector<int64_t>& free = out[size_t(r)].free;
      size_t row = free.size();  // the fullest row it fits in
      for (size_t k = 0; k < free.size(); ++k)
        if (free[k] >= n && (row == free.size() || free[k] < free[row])) row = k;
      if (row < free.size()) best_rank = r, best_row = row;
    }
    if (best_rank < 0) return false;
    Filling& f = out[size_t(best_rank)];
    f.rows[best_row].push_back(i);
    f.free[best_row] -= n;
    load[size_t(best_rank)] += cost.b * double(n) * double(n);
  }
  return true;
}

}  // namespace

Packing pack_sequences(const std::vector<int64_t>& lengths, int ranks, int64_t row_len, int64_t rows_multiple,
                       Balance balance, const SequenceCost& cost) {
  ORIGAMI_ASSERT(ranks >= 1 && row_len >= 1 && rows_multiple >= 1);
  int64_t total = 0;
  for (const int64_t n : lengths) {
    ORIGAMI_ASSERT(n >= 1 && n <= row_len);
    total += n;
  }
  std::vector<Filling> fill;
  if (balance == Balance::none) {
    fill = deal(lengths, ranks, row_len);
  } else {
    int64_t rows = std::max<int64_t>(1, (total + ranks * row_len - 1) / (ranks * row_len));
    while (!lpt(lengths, ranks, row_len, rows, cost, fill)) ++rows;  // ends: one row per sequence always fits
  }
  Packing p;
  for (const Filling& f : fill) p.rows = std::max<int64_t>(p.rows, int64_t(f.rows.size()));
  p.rows = std::max<int64_t>(1, (p.rows + rows_multiple - 1) / rows_multiple) * rows_multiple;
  for (Filling& f : fill) {
    double c = cost.a * double(p.rows * row_len);  // every row's GEMMs, padding included
    for (const std::vector<int32_t>& row : f.rows)
      for (const int32_t i : row) c += cost.b * double(lengths[size_t(i)]) * double(lengths[size_t(i)]);
    f.rows.resize(size_t(p.rows));
    p.ranks.push_back(std::move(f.rows));
    p.cost.push_back(c);
  }
  return p;
}

}  // namespace origami
