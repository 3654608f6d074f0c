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
//         sequence, longest first, to the worker whose sum of n² is lowest among those with a row it
//         fits in (the row that it fills best); when the step's rows round up to whole micro-batches
//         (and pipeline multiples), LPT again into all of them, kept when its busiest rank is lighter
//         (without CP). The sums are of n² (over d under CP), not b·n²: b's
//         scale cancels, and sums of integers compare exactly, so the placement depends on the lengths
//         alone, whatever costs were measured (a resumed run places as the first did).
//   flex  (a CP degree per sequence only) lpt, with each sequence's degree chosen for balance, not
//         only for fit: FlexSP's groups sized per sequence by its cost, found by a greedy search instead
//         of FlexSP's MILP. From the least degrees, a sequence of the busiest rank is moved one degree
//         up while that lowers the busiest rank's n²/d by 1% or more (the CP exchanges it adds are not
//         in the estimate) without adding a micro-batch, or saves one at no more estimated cost on
//         the busiest rank (pack_sequences_cp).
//
// Under context parallelism with a CP degree per sequence (pack_sequences_cp), ByteScale's dynamic DP×CP
// with FlexSP's groups of several sizes: a sequence runs at the least degree d of cp_degrees(C) whose
// rows of d·L/C tokens hold it (flex: or a larger one), over an aligned subgroup of d of its DP group's
// C CP ranks (d = 1: on one rank, no CP traffic; d = C: the whole group), each rank holding L/C
// positions of every row, so every micro-batch has the same local shape [B, L/C] at any degree. A rank
// runs its micro-batches of the largest degree first, then the next: aligned subgroups nest, so the
// ranks of a subgroup reach its micro-batches at the same index. Under lpt and flex the shorter
// sequences first fill the padding of the larger degrees' rows (free compute, 1/d of their attention
// per rank).
#pragma once
#include <cstdint>
#include <string_view>
#include <vector>

#include "parallel/context_parallel.h"  // cp_degrees

namespace origami {

enum class Balance { none, lpt, flex };
Balance parse_balance(std::string_view name);  // "none", "lpt" or "flex"; else an Error naming the value
const char* balance_name(Balance b);

// The estimated cost of a sequence of n tokens: a·n + b·n² (any unit: it sizes the estimate, while
// the placement weighs n² alone).
struct SequenceCost {
  double a = 1, b = 0;
  double operator()(int64_t n) const { return a * double(n) + b * double(n) * double(n); }
};

using Rows = std::vector<std::vector<int32_t>>;  // rows, each the step's sequence indices in it

// max / mean of per-rank costs (1 when all are 0).
double imbalance(const std::vector<double>& cost);
// A lower bound of the max / mean of any placement in the same rows (not always reachable): every rank
// costs `common` (its rows' a·L) plus b times its attention, whose mean is fixed, and the busiest
// carries at least `floor` of it (the mean, or the heaviest sequence's share: n², or n²/C over a CP
// group, lies on one rank whole).
double imbalance_bound(double common, double b, double mean, double floor);

struct Packing {
  int64_t rows = 0;                 // per rank, a multiple of rows_multiple
  std::vector<Rows> ranks;          // [rank]
  std::vector<double> cost;         // per rank: its rows' a·L each plus b·n² per sequence
  double bound = 1;                 // imbalance_bound for these rows
  double imbalance() const { return origami::imbalance(cost); }
};

// lengths[i]: sequence i's tokens (each in [1, row_len]).
Packing pack_sequences(const std::vector<int64_t>& lengths, int ranks, int64_t row_len, int64_t rows_multiple,
                       Balance balance, const SequenceCost& cost);

struct CpPacking {
  int64_t micro = 0;                     // micro-batches per rank, a multiple of micro_multiple
  std::vector<std::vector<int>> degree;  // [rank][micro-batch]: the degree d it runs at, over the aligned
                                         // subgroup of d CP ranks holding the rank
  std::vector<Rows> ranks;               // [group·C + cp rank]: B rows per micro-batch, of d·row_len/C tokens,
                                         // the same on every rank of the micro-batch's subgroup
  std::vector<int64_t> sequences;        // [degree index]: the sequences run at each degree of cp_degrees(C)
  std::vector<double> attention;         // per rank: n²/d per sequence
  double floor = 0;                      // the least attention any placement leaves its busiest rank: the
                                         // mean, or the heaviest sequence's n²/C
  std::vector<double> cost;              // per rank: a·(its tokens, padding included) + b·n²/d per sequence
  double bound = 1;                      // imbalance_bound for these micro-batches
  double imbalance() const { return origami::imbalance(cost); }
};

// groups DP groups of cp ranks each; rows of B per micro-batch; row_len a multiple of cp. `cost` sizes
// the estimate; flex weighs a micro-batch saved against attention added by `weigh`, the FLOP counts,
// so that the placement depends on the lengths and the model alone, whatever costs were measured.
CpPacking pack_sequences_cp(const std::vector<int64_t>& lengths, int groups, int cp, int64_t row_len, int64_t B,
                            int64_t micro_multiple, Balance balance, const SequenceCost& cost, const SequenceCost& weigh);

}  // namespace origami
