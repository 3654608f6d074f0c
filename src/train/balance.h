// Placing a step's sequences (document batching) on the data-parallel ranks, packed into rows.
//
// Every micro-batch is B rows of L tokens (--micro-batch x --seq-len); a row holds whole sequences
// back to back (document-masked: attention stays inside each, positions restart) and padding after
// them. Every DP rank runs the same number of micro-batches — the ranks meet in collectives every
// micro-batch (expert all-to-all, ZeRO-3 gathers) — so a row costs its tokens' GEMMs whatever it holds,
// and what differs between ranks is the attention: c(n) = a·n + b·n² per sequence of n tokens.
//
//   none  sequence i goes to worker i mod workers; each worker fills its rows in order (next fit).
//   lpt   longest-processing-time first: the fewest rows per worker that hold the step, then each
//         sequence, longest first, to the worker whose estimated b·n² sum is lowest among those with
//         a row it fits in (the row that it fills best).
//
// Under context parallelism with a CP degree per sequence (pack_sequences_cp): a sequence of at most
// L/C tokens runs on one rank (rows of L/C: no CP traffic), a longer one over its DP group's C ranks
// (rows of L, each rank T/C of them). Every micro-batch has the same local shape [B, L/C] either way.
// A group first runs its micro-batches over the group, then its ranks their own ones. Under lpt short
// sequences first fill the padding of the group's rows (free compute, 1/C of their attention per rank).
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

using Rows = std::vector<std::vector<int32_t>>;  // rows, each the step's sequence indices in it

// max / mean of per-rank costs (1 when all are 0).
double imbalance(const std::vector<double>& cost);

struct Packing {
  int64_t rows = 0;                 // per rank, a multiple of rows_multiple
  std::vector<Rows> ranks;          // [rank]
  std::vector<double> cost;         // per rank: its rows' a·L each plus b·n² per sequence
  double imbalance() const { return origami::imbalance(cost); }
};

// lengths[i]: sequence i's tokens (each in [1, row_len]).
Packing pack_sequences(const std::vector<int64_t>& lengths, int ranks, int64_t row_len, int64_t rows_multiple,
                       Balance balance, const SequenceCost& cost);

struct CpPacking {
  int64_t micro = 0;              // micro-batches per rank, a multiple of micro_multiple
  std::vector<int64_t> joint;     // [group]: its first joint[g] micro-batches run over the group
  std::vector<Rows> groups;       // [group]: rows of row_len, joint[g]·B of them (long sequences, and short ones in their gaps)
  std::vector<Rows> ranks;        // [group·C + cp rank]: rows of row_len / C, (micro − joint[g])·B of them
  std::vector<double> cost;       // per rank: a·(its tokens, padding included) + b·n² (n²/C over the group)
  double imbalance() const { return origami::imbalance(cost); }
};

// groups DP groups of cp ranks each; rows of B per micro-batch; row_len a multiple of cp.
CpPacking pack_sequences_cp(const std::vector<int64_t>& lengths, int groups, int cp, int64_t row_len, int64_t B,
                            int64_t micro_multiple, Balance balance, const SequenceCost& cost);

}  // namespace origami
