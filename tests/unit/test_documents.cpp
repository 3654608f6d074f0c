// Document batching: the step rule (data/documents.h) and the packing of a step's sequences into rows
// on the DP ranks (train/balance.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "core/checked.h"
#include "core/error.h"
#include "data/documents.h"
#include "train/balance.h"
#include "train/trainer.h"

using namespace origami;

namespace {

// A dataset of documents with these lengths; document d's tokens are 1000·d + 0, 1, 2, ...
std::string write_documents(const std::string& name, const std::vector<int>& lengths) {
  const std::string prefix = (std::filesystem::temp_directory_path() / name).string();
  IndexedDatasetWriter w(prefix, TokenDtype::int32);
  for (size_t d = 0; d < lengths.size(); ++d) {
    std::vector<int32_t> doc(size_t(lengths[d]));
    std::iota(doc.begin(), doc.end(), int32_t(1000 * d));
    w.add_document(doc);
  }
  w.finish();
  return prefix;
}

std::vector<int64_t> step_lengths(DocumentBatcher& b, int64_t s) {
  std::vector<int64_t> out;
  for (const Sequence& q : b.step(s)) out.push_back(q.length);
  return out;
}

// Documents of 5, 12, 1 and 9 tokens with L = 4 make pieces 4 1 | 4 4 4 | 1 | 4 4 1; steps take the
// next ones while they fit in N = 10 tokens, then the documents repeat.
TEST(DocumentBatcher, CutsAtTheLengthAndFillsStepsInOrder) {
  const IndexedDataset ds = IndexedDataset::open(write_documents("origami_docs_rule", {5, 12, 1, 9}));
  DocumentBatcher b(ds, 4, 10, SampleOrder::sequential, 1);
  EXPECT_EQ(step_lengths(b, 0), (std::vector<int64_t>{4, 1, 4}));  // the next 4 would make 13
  EXPECT_EQ(step_lengths(b, 1), (std::vector<int64_t>{4, 4, 1}));
  EXPECT_EQ(step_lengths(b, 2), (std::vector<int64_t>{4, 4, 1}));
  EXPECT_EQ(step_lengths(b, 3), (std::vector<int64_t>{4, 1, 4}));  // epoch 2 begins inside step 3
  EXPECT_TRUE(b.repeats(4));
  EXPECT_FALSE(b.repeats(3));
  // The tokens: step 1 is the second document's second and third pieces, then the third document.
  const std::vector<Sequence>& s1 = b.step(1);
  std::vector<int32_t> got(4);
  b.read(s1[1], got.data());
  EXPECT_EQ(got, (std::vector<int32_t>{1008, 1009, 1010, 1011}));
  b.read(s1[2], got.data());
  EXPECT_EQ(got[0], 2000);
  // Going back replays the rule from step 0.
  EXPECT_EQ(step_lengths(b, 0), (std::vector<int64_t>{4, 1, 4}));
}

// Shuffled: each epoch a permutation of the documents, the same for every batcher of the same seed.
TEST(DocumentBatcher, ShuffledOrderIsAPermutationPerEpoch) {
  std::vector<int> lengths(50);
  std::iota(lengths.begin(), lengths.end(), 1);  // document d has d + 1 tokens: its length names it
  const IndexedDataset ds = IndexedDataset::open(write_documents("origami_docs_shuffle", lengths));
  DocumentBatcher a(ds, 64, 64, SampleOrder::shuffled, 9), b(ds, 64, 64, SampleOrder::shuffled, 9);
  std::vector<int64_t> seen;
  for (int64_t s = 0; seen.size() < 50; ++s) {
    const std::vector<int64_t> got = step_lengths(a, s);
    EXPECT_EQ(got, step_lengths(b, s));
    seen.insert(seen.end(), got.begin(), got.end());
  }
  seen.resize(50);
  EXPECT_EQ(std::set<int64_t>(seen.begin(), seen.end()).size(), 50u) << "epoch 0 reads every document once";
  EXPECT_FALSE(std::is_sorted(seen.begin(), seen.end()));
}

// A blend interleaves whole documents by tokens: dataset a's documents of 4 tokens and b's of 2 at
// 0.5 / 0.5 go a b b a b b ... (w_d·(T+1) − T_d, the first on ties), a document of 6 cut at L = 4 keeps its
// pieces together, and every prefix holds each dataset's tokens within one document of its share.
TEST(DocumentBatcher, BlendsInterleaveWholeDocumentsByTokens) {
  const IndexedDataset a = IndexedDataset::open(write_documents("origami_docs_blend_a", {4, 4, 6, 4}));
  const IndexedDataset b = IndexedDataset::open(write_documents("origami_docs_blend_b", {2, 2, 2, 2, 2}));
  DocumentBatcher blend({&a, &b}, {1.0, 1.0}, 4, StepSizes(4), SampleOrder::sequential, 1);
  std::vector<std::pair<int32_t, int64_t>> got;  // (dataset, length) of steps 0..9, one step a sequence or two
  for (int64_t s = 0; s < 10; ++s)
    for (const Sequence& q : blend.step(s)) got.emplace_back(q.part, q.length);
  const std::vector<std::pair<int32_t, int64_t>> want = {{0, 4}, {1, 2}, {1, 2}, {0, 4}, {1, 2}, {1, 2},
                                                         {0, 4}, {0, 2}, {1, 2}, {1, 2}, {1, 2}, {0, 4},
                                                         {1, 2}, {1, 2}, {0, 4}};
  EXPECT_EQ(got, want);
  // 0.75 / 0.25 over many steps: the running token counts stay within a document (6) of the shares.
  DocumentBatcher uneven({&a, &b}, {3.0, 1.0}, 4, StepSizes(8), SampleOrder::shuffled, 3);
  int64_t taken[2] = {0, 0};
  for (int64_t s = 0; s < 200; ++s) {
    for (const Sequence& q : uneven.step(s)) taken[q.part] += q.length;
    const double total = double(taken[0] + taken[1]);
    EXPECT_LE(std::abs(double(taken[0]) - 0.75 * total), 6.0) << "after step " << s;
  }
  EXPECT_TRUE(uneven.repeats(200));
  EXPECT_EQ(uneven.num_documents(), 9);
}

TEST(DocumentBatcher, RejectsAStepShorterThanASequence) {
  const IndexedDataset ds = IndexedDataset::open(write_documents("origami_docs_bad", {3}));
  EXPECT_THROW(DocumentBatcher(ds, 8, 4, SampleOrder::sequential, 1), Error);
  // ... in any stretch of a resumed run's steps
  EXPECT_THROW(DocumentBatcher({&ds}, {1.0}, 8, StepSizes({{0, 16}, {5, 4}}, "test"), SampleOrder::sequential, 1), Error);
}

// A run resumed under another N (stretches of step sizes) takes the same stream of sequences: none
// skipped, none repeated; each step holds at most its own N and the next sequence did not fit.
TEST(DocumentBatcher, AnotherStepSizeContinuesTheStream) {
  const IndexedDataset a = IndexedDataset::open(write_documents("origami_docs_resize_a", {5, 9, 3, 12, 1, 7, 2, 8}));
  const IndexedDataset b = IndexedDataset::open(write_documents("origami_docs_resize_b", {4, 6, 2, 10}));
  for (const SampleOrder order : {SampleOrder::sequential, SampleOrder::shuffled}) {
    DocumentBatcher one({&a, &b}, {2.0, 1.0}, 8, StepSizes(12), order, 5);
    const StepSizes sizes({{0, 12}, {7, 20}, {15, 8}}, "test");
    DocumentBatcher resized({&a, &b}, {2.0, 1.0}, 8, sizes, order, 5);
    std::vector<std::tuple<int32_t, uint64_t, int64_t>> stream, got;
    for (int64_t s = 0; s < 30; ++s) {
      int64_t tokens = 0;
      for (const Sequence& q : resized.step(s)) got.emplace_back(q.part, q.first, q.length), tokens += q.length;
      EXPECT_LE(tokens, sizes.size(s)) << "step " << s;
    }
    for (int64_t s = 0; got.size() > stream.size(); ++s)
      for (const Sequence& q : one.step(s)) stream.emplace_back(q.part, q.first, q.length);
    stream.resize(got.size());
    EXPECT_EQ(got, stream);
    // Going back replays the stretches: step 20 again, after step 29.
    std::vector<std::tuple<int32_t, uint64_t, int64_t>> again;
    for (const Sequence& q : resized.step(20)) again.emplace_back(q.part, q.first, q.length);
    DocumentBatcher fresh({&a, &b}, {2.0, 1.0}, 8, sizes, order, 5);
    std::vector<std::tuple<int32_t, uint64_t, int64_t>> want;
    for (const Sequence& q : fresh.step(20)) want.emplace_back(q.part, q.first, q.length);
    EXPECT_EQ(again, want);
  }
}

TEST(StepSizes, StretchesSumAndResume) {
  const StepSizes s({{0, 4}, {3, 10}, {5, 2}}, "test");
  EXPECT_EQ(s.size(0), 4);
  EXPECT_EQ(s.size(2), 4);
  EXPECT_EQ(s.size(3), 10);
  EXPECT_EQ(s.size(100), 2);
  EXPECT_EQ(s.before(0), 0);
  EXPECT_EQ(s.before(3), 12);
  EXPECT_EQ(s.before(5), 32);
  EXPECT_EQ(s.before(7), 36);
  EXPECT_EQ(s.largest(), 10);
  // A resume at step 4 drops what came after it; the same size adds no stretch.
  EXPECT_EQ(s.resumed(4, 6).stretches(), (std::vector<StepSizes::Stretch>{{0, 4}, {3, 10}, {4, 6}}));
  EXPECT_EQ(s.resumed(4, 10).stretches(), (std::vector<StepSizes::Stretch>{{0, 4}, {3, 10}}));
  EXPECT_EQ(s.resumed(3, 4).stretches(), (std::vector<StepSizes::Stretch>{{0, 4}}));
  EXPECT_EQ(StepSizes(8).resumed(0, 6).stretches(), (std::vector<StepSizes::Stretch>{{0, 6}}));
  EXPECT_THROW(StepSizes({{1, 4}}, "test"), Error);
  EXPECT_THROW(StepSizes({{0, 4}, {0, 5}}, "test"), Error);
  EXPECT_THROW(StepSizes({{0, 0}}, "test"), Error);
  EXPECT_THROW(StepSizes({{0, int64_t(1) << 62}}, "test").before(5), SizeOverflow);
}

// Every sequence is placed once, rows hold at most row_len tokens, every rank has the same number of
// rows (a multiple of the micro-batch), and lpt needs no more rows than dealing them round-robin.
TEST(PackSequences, PlacesEverySequenceOnceWithinTheRows) {
  const std::vector<int64_t> lengths = {30, 1, 7, 32, 16, 16, 2, 25, 9, 9, 31, 4, 1, 12};
  const SequenceCost cost{100, 1};
  for (const Balance balance : {Balance::none, Balance::lpt})
    for (const int ranks : {1, 2, 3, 4}) {
      const Packing p = pack_sequences(lengths, ranks, 32, 2, balance, cost);
      ASSERT_EQ(p.ranks.size(), size_t(ranks));
      EXPECT_EQ(p.rows % 2, 0);
      std::vector<int> placed(lengths.size(), 0);
      for (const auto& rows : p.ranks) {
        EXPECT_EQ(int64_t(rows.size()), p.rows);
        for (const auto& row : rows) {
          int64_t used = 0;
          for (const int32_t i : row) used += lengths[size_t(i)], ++placed[size_t(i)];
          EXPECT_LE(used, 32);
        }
      }
      EXPECT_EQ(placed, std::vector<int>(lengths.size(), 1)) << balance_name(balance) << " on " << ranks << " ranks";
    }
  EXPECT_LE(pack_sequences(lengths, 2, 32, 1, Balance::lpt, cost).rows,
            pack_sequences(lengths, 2, 32, 1, Balance::none, cost).rows);
}

// lpt balances the attention part b·n² over the ranks: one long sequence and four of half its length on
// two ranks of two rows of 32 put the long one alone; round-robin dealing does not.
TEST(PackSequences, LptBalancesTheQuadraticCost) {
  const std::vector<int64_t> lengths = {32, 16, 16, 16, 16};  // 4·16² = 32²
  const SequenceCost cost{0, 1};
  const Packing lpt = pack_sequences(lengths, 2, 32, 1, Balance::lpt, cost);
  EXPECT_EQ(lpt.rows, 2);
  EXPECT_EQ(lpt.cost, (std::vector<double>{1024, 1024}));
  EXPECT_DOUBLE_EQ(lpt.imbalance(), 1.0);
  const Packing none = pack_sequences(lengths, 2, 32, 1, Balance::none, cost);
  EXPECT_DOUBLE_EQ(none.imbalance(), 1.5);  // 32, 16, 16 on rank 0: 1536 against 512
  EXPECT_THROW(parse_balance("greedy"), Error);
}

// The step runs whole micro-batches: lengths {80, 45, 45, 10, 10, 10} on 2 ranks in rows of 100 fit one
// row each (n² loads 6600 and 4150), but a micro-batch of 2 rows runs two anyway, and with two rows to
// place into LPT evens them to 6400 and 4350, in as many micro-batches.
TEST(PackSequences, LptUsesTheRowsTheMicroBatchesRun) {
  const std::vector<int64_t> lengths = {80, 45, 45, 10, 10, 10};
  const Packing one = pack_sequences(lengths, 2, 100, 1, Balance::lpt, SequenceCost{0, 1});
  const Packing two = pack_sequences(lengths, 2, 100, 2, Balance::lpt, SequenceCost{0, 1});
  EXPECT_EQ(one.rows, 1);
  EXPECT_EQ(one.cost, (std::vector<double>{6600, 4150}));
  EXPECT_EQ(two.rows, 2);
  EXPECT_EQ(two.cost, (std::vector<double>{6400, 4350}));
}

// The placement depends on the lengths alone: costs of any scale (FLOP counts, seconds measured at
// start, a cluster file's) place every sequence in the same row, with and without a CP degree per
// sequence (flex weighs by the FLOP counts, passed apart), and only the reported costs differ. Equal sums of n² (4·16² = 32², and the random steps'
// many small ones) make ties that sums of b·n² in floating point could break either way.
TEST(PackSequences, PlacementIgnoresTheCoefficients) {
  std::vector<std::vector<int64_t>> steps = {{32, 16, 16, 16, 16, 3, 5, 4, 12, 9, 9, 1, 30, 7, 7, 20, 11}};
  uint64_t state = 7;
  for (int k = 0; k < 20; ++k) {
    std::vector<int64_t> lengths;
    for (int i = 0; i < 40; ++i) state = state * 6364136223846793005ULL + 1442695040888963407ULL,
                                 lengths.push_back(1 + int64_t((state >> 33) % 32));
    steps.push_back(lengths);
  }
  const SequenceCost unit{1, 1};
  for (const std::vector<int64_t>& lengths : steps)
    for (const SequenceCost cost : {SequenceCost{6e8, 3e5}, SequenceCost{1.7e-9, 3.1e-12}, SequenceCost{1, 0.1},
                                    SequenceCost{1, 1.0 / 3}}) {
      const Packing a = pack_sequences(lengths, 3, 32, 1, Balance::lpt, unit);
      const Packing b = pack_sequences(lengths, 3, 32, 1, Balance::lpt, cost);
      EXPECT_EQ(a.ranks, b.ranks) << "b = " << cost.b;
      EXPECT_NE(a.cost, b.cost);
      for (const Balance balance : {Balance::lpt, Balance::flex}) {
        const CpPacking c = pack_sequences_cp(lengths, 2, 4, 32, 1, 1, balance, unit, unit);
        const CpPacking d = pack_sequences_cp(lengths, 2, 4, 32, 1, 1, balance, cost, unit);
        EXPECT_EQ(c.ranks, d.ranks) << "b = " << cost.b << " " << balance_name(balance);
        EXPECT_EQ(c.degree, d.degree);
      }
    }
}

}  // namespace

namespace {

// What every packing with a CP degree per sequence must be: every rank runs the same number of
// micro-batches, largest degree first; a micro-batch of degree d has the same degree and rows on every
// rank of its aligned subgroup, rows of at most d·L/C tokens, and every sequence runs once at a degree
// that holds it (none: the least; lpt: or a larger one's gap; flex: or larger).
void expect_valid(const CpPacking& p, const std::vector<int64_t>& lengths, int groups, int C, int64_t L, int64_t B,
                  Balance balance) {
  const std::vector<int> degrees = cp_degrees(C);
  std::vector<int> placed(lengths.size(), 0);
  ASSERT_EQ(p.ranks.size(), size_t(groups * C));
  for (size_t r = 0; r < p.ranks.size(); ++r) {
    ASSERT_EQ(int64_t(p.ranks[r].size()), p.micro * B);
    ASSERT_EQ(int64_t(p.degree[r].size()), p.micro);
    EXPECT_TRUE(std::is_sorted(p.degree[r].rbegin(), p.degree[r].rend())) << "largest degree first";
    for (int64_t m = 0; m < p.micro; ++m) {
      const int d = p.degree[r][size_t(m)];
      ASSERT_NE(std::find(degrees.begin(), degrees.end(), d), degrees.end());
      const size_t first = r - r % size_t(d);  // the aligned subgroup (inside r's DP group: d divides C)
      for (size_t q = first; q < first + size_t(d); ++q) {
        EXPECT_EQ(p.degree[q][size_t(m)], d) << "C " << C << " rank " << r << " micro-batch " << m;
        for (int64_t b = 0; b < B; ++b) EXPECT_EQ(p.ranks[q][size_t(m * B + b)], p.ranks[r][size_t(m * B + b)]);
      }
      for (int64_t b = 0; b < B; ++b) {
        int64_t used = 0;
        for (const int32_t i : p.ranks[r][size_t(m * B + b)]) {
          const int64_t n = lengths[size_t(i)];
          const int least = *std::find_if(degrees.begin(), degrees.end(), [&](int k) { return n <= k * (L / C); });
          if (balance == Balance::none) EXPECT_EQ(d, least);
          EXPECT_GE(d, least);
          used += n, placed[size_t(i)] += r == first;
        }
        EXPECT_LE(used, d * (L / C));
      }
    }
  }
  EXPECT_EQ(placed, std::vector<int>(lengths.size(), 1)) << "C " << C << " " << balance_name(balance);
  EXPECT_EQ(std::accumulate(p.sequences.begin(), p.sequences.end(), int64_t(0)), int64_t(lengths.size()));
  EXPECT_EQ(p.cost.size(), size_t(groups * C));
}

// On 1 or 2 DP groups of C = 2, 4 and 6 CP ranks, every balancer packs validly.
TEST(PackSequencesCp, EachSequenceOnceOverAnAlignedSubgroup) {
  const std::vector<int64_t> lengths = {96, 40, 3, 16, 16, 9, 33, 1, 12, 16, 7, 50, 2, 2, 30, 20, 11, 64, 25};
  const SequenceCost cost{100, 1};
  const int64_t L = 96, B = 2;
  for (const int C : {2, 4, 6})
    for (const int groups : {1, 2})
      for (const Balance balance : {Balance::none, Balance::lpt, Balance::flex})
        expect_valid(pack_sequences_cp(lengths, groups, C, L, B, 1, balance, cost, cost), lengths, groups, C, L, B, balance);
  EXPECT_EQ(cp_degrees(8), (std::vector<int>{1, 2, 4, 8}));
  EXPECT_EQ(cp_degrees(6), (std::vector<int>{1, 2, 6}));
  // lpt puts a short sequence into the padding of a group's row: 40 + 20 tokens run as one micro-batch.
  const SequenceCost quadratic{100, 1};
  const CpPacking gap = pack_sequences_cp({40, 20}, 1, 2, 64, 1, 1, Balance::lpt, quadratic, quadratic);
  EXPECT_EQ(gap.micro, 1);
  EXPECT_EQ(gap.ranks[0], (Rows{{0, 1}}));
  EXPECT_EQ(pack_sequences_cp({40, 20}, 1, 2, 64, 1, 1, Balance::none, quadratic, quadratic).micro, 2);
  // CP4, L = 64: 60 tokens over all 4 ranks, 30 over 2 of them, 10 on one.
  const CpPacking three = pack_sequences_cp({60, 30, 10}, 1, 4, 64, 1, 1, Balance::none, quadratic, quadratic);
  EXPECT_EQ(three.sequences, (std::vector<int64_t>{1, 1, 1}));
  // Interleaved pipelines need whole multiples of the stages.
  EXPECT_EQ(pack_sequences_cp(lengths, 1, 2, 96, 1, 4, Balance::lpt, cost, cost).micro % 4, 0);
  EXPECT_EQ(pack_sequences_cp(lengths, 1, 2, 96, 1, 4, Balance::flex, cost, cost).micro % 4, 0);
}

// flex raises a sequence's degree where that balances the ranks. CP2, L = 64: lpt runs 32 tokens on one
// rank (it fits in L/2) and the four 8s on the other, attention 1024 against 256; flex runs the 32 over
// both ranks with the 8s in its row's gap, 640 each, in as many micro-batches.
TEST(PackSequencesCp, FlexRaisesTheHeavySequence) {
  const SequenceCost quadratic{0, 1};
  const std::vector<int64_t> lengths = {32, 8, 8, 8, 8};
  const CpPacking lpt = pack_sequences_cp(lengths, 1, 2, 64, 1, 1, Balance::lpt, quadratic, quadratic);
  EXPECT_EQ(lpt.micro, 1);
  EXPECT_EQ(lpt.degree[0], std::vector<int>{1});
  EXPECT_EQ(lpt.attention, (std::vector<double>{1024, 256}));
  EXPECT_DOUBLE_EQ(lpt.imbalance(), 1.6);
  const CpPacking flex = pack_sequences_cp(lengths, 1, 2, 64, 1, 1, Balance::flex, quadratic, quadratic);
  EXPECT_EQ(flex.micro, 1);
  EXPECT_EQ(flex.degree[0], std::vector<int>{2});
  EXPECT_EQ(flex.ranks[0], (Rows{{0, 1, 2, 3, 4}}));
  EXPECT_EQ(flex.attention, (std::vector<double>{640, 640}));
  EXPECT_DOUBLE_EQ(flex.imbalance(), 1.0);
  EXPECT_DOUBLE_EQ(flex.bound, 1.0);  // 512 (32²/2) under the mean, 640
  // Balanced already (two 32s a rank): nothing is raised.
  const CpPacking even = pack_sequences_cp({32, 32, 32, 32}, 1, 2, 64, 1, 1, Balance::flex, quadratic, quadratic);
  EXPECT_EQ(even.degree[0], (std::vector<int>{1, 1}));
}

// flex never packs worse than lpt: no more micro-batches, no higher estimated cost on the busiest rank
// (a·its rows + b·n²/d, the costs it weighs by), and no heavier busiest rank in as many micro-batches; it packs validly (B = 1 to 3 rows per
// micro-batch, whole multiples of 2 micro-batches); and no packing's estimated imbalance is below its
// bound. Random long-tailed steps on 1 and 2 groups of CP 2 and 4.
TEST(PackSequencesCp, FlexNeverWorseThanLptAndTheBoundHolds) {
  std::mt19937_64 rng(11);
  const int64_t L = 64, N = 512;
  int better = 0, cases = 0;
  auto most = [](const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); };
  for (int trial = 0; trial < 100; ++trial) {
    std::vector<int64_t> lengths;
    for (int64_t total = 0;;) {
      const int64_t n = std::min<int64_t>(L, 1 + int64_t(std::exponential_distribution<double>(0.06)(rng)));
      if (total + n > N) break;
      lengths.push_back(n), total += n;
    }
    for (const int groups : {1, 2})
      for (const int C : {2, 4})
        for (const int64_t B : {1, 2, 3})
          for (const SequenceCost cost : {SequenceCost{50, 1}, SequenceCost{7, 1}, SequenceCost{1000, 1}}) {
            const int64_t multiple = B == 2 ? 2 : 1;
            const CpPacking lpt = pack_sequences_cp(lengths, groups, C, L, B, multiple, Balance::lpt, cost, cost);
            const CpPacking flex = pack_sequences_cp(lengths, groups, C, L, B, multiple, Balance::flex, cost, cost);
            expect_valid(flex, lengths, groups, C, L, B, Balance::flex);
            ASSERT_EQ(flex.micro % multiple, 0);
            ASSERT_LE(flex.micro, lpt.micro) << "trial " << trial;
            if (flex.micro == lpt.micro) ASSERT_LE(most(flex.attention), most(lpt.attention)) << "trial " << trial;
            ASSERT_LE(most(flex.cost), most(lpt.cost)) << "trial " << trial;
            better += flex.micro < lpt.micro || most(flex.attention) < most(lpt.attention), ++cases;
            for (const CpPacking* p : {&lpt, &flex}) EXPECT_GE(p->imbalance(), p->bound - 1e-12) << "trial " << trial;
          }
    const Packing whole = pack_sequences(lengths, 4, L, 1, Balance::lpt, SequenceCost{50, 1});
    EXPECT_GE(whole.imbalance(), whole.bound - 1e-12);
    EXPECT_GE(whole.bound, 1.0);
  }
  EXPECT_GT(better, cases / 8) << "flex packs better than lpt on few of the " << cases << " steps";
}

}  // namespace

namespace {

// TrainOptions::micro_batches under document batching bounds what the packers produce (the memory
// plan, the schedule check and the MPI tags are sized by it): random steps of long-tailed lengths on
// DP 1, 2, 4, with and without a CP degree per sequence, 1 to 3 rows per micro-batch, both balancers.
TEST(DocumentBatching, MicroBatchBoundHoldsForEveryPacking) {
  std::mt19937_64 rng(7);
  const int64_t L = 32, N = 160;
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<int64_t> lengths;
    int64_t total = 0;
    for (;;) {
      const int64_t n = std::min<int64_t>(L, 1 + int64_t(std::exponential_distribution<double>(0.08)(rng)));
      if (total + n > N) break;
      lengths.push_back(n), total += n;
    }
    for (const int dp : {1, 2, 4})
      for (const int cp : {1, 2, 4})
        for (const int64_t B : {1, 2, 3})
          for (const char* balance : {"none", "lpt", "flex"}) {
            if (cp == 1 && balance == std::string("flex")) continue;  // flex needs a CP degree per sequence
            TrainOptions o;
            o.batching = "documents", o.balance = balance, o.seq_len = L, o.tokens_per_step = N, o.micro_batch = B;
            o.cp = cp, o.dp = dp;
            const int64_t bound = o.micro_batches(dp * cp);
            const Balance b = parse_balance(balance);
            const int64_t got = cp == 1 ? pack_sequences(lengths, dp, L, B, b, SequenceCost{1, 1}).rows / B
                                        : pack_sequences_cp(lengths, dp, cp, L, B, 1, b, SequenceCost{1, 1}, SequenceCost{1, 1}).micro;
            ASSERT_LE(got, bound) << "dp " << dp << " cp " << cp << " B " << B << " " << balance << " trial " << trial;
          }
  }
}

}  // namespace

// Sequences all just over half a row take a row each: the search for LPT's fewest rows starts there
// (no two share a row), where it tried every row count from the tokens' bound up, each an LPT pass —
// 1,500 such sequences on one rank took seconds; the packing is the same.
TEST(PackSequences, FewestRowsStartsAtTheSequencesOverHalfARow) {
  const std::vector<int64_t> lengths(1500, 520);
  const auto t0 = std::chrono::steady_clock::now();
  const Packing p = pack_sequences(lengths, 1, 1000, 1, Balance::lpt, SequenceCost{1, 1});
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(p.rows, 1500);
  EXPECT_LT(s, 0.5);
}
