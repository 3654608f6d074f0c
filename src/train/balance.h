// Placing a step's sequences (document batching) on the data-parallel ranks, packed into rows.
//
// Every micro-batch is B rows of L tokens (--micro-batch x --seq-len); a row holds whole sequences
// back to back (document-masked: attention stays inside each, positions restart) and padding after
// them. Every DP rank runs the same number of rows — the ranks meet in collectives every micro-batch
// (expert all-to-all, ZeRO-3 gathers) — so a row costs its L tokens' GEMMs whatever it holds, and what
// differs between ranks is the attention: c(n) = a·n + b·n² per sequence of n tokens.
//
//   none  sequence i goes to rank i mod DP; each rank fills its rows in order (next fit).
//   lpt   longest-processing-time first: the fewest rows per rank that hold the step, then each
//         sequence, longest first, to the rank whose estimated cost is lowest among those with a row
//         it fits in (the row that it fills best).
#pragma once
#include <cstdint>
#include <string_view>
#include <vector>

namespace origami {

enum class Balance { none, lpt };
Balance parse_balance(std::string_view name);  // "none" or "lpt"; else an Error naming the value
const char* balance_name(Balance b);

// The estimated cost of a sequence of n tokens: a·n + b·n² (any unit; only ratios are used).
struct SequenceCost {
  double a = 1, b = 0;
  double operator()(int64_t n) const { return a * double(n) + b * double(n) * double(n); }
};

struct Packing {
  int64_t rows = 0;                                       // per rank, a multiple of rows_multiple
  std::vector<std::vector<std::vector<int32_t>>> ranks;   // [rank][row]: the step's sequence indices in it
  std::vector<double> cost;                               // per rank: its rows' a·L each plus b·n² per sequence
  double imbalance() const;                               // max / mean of cost
};

// lengths[i]: sequence i's tokens (each in [1, row_len]).
Packing pack_sequences(const std::vector<int64_t>& lengths, int ranks, int64_t row_len, int64_t rows_multiple,
                       Balance balance, const SequenceCost& cost);

}  // namespace origami
