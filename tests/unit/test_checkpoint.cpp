// Universal checkpoints' building blocks: the checksum, shard_runs (where a piece's elements lie in
// the global tensor), on which every reshard depends, and replace_dir, by which a step saved again
// takes the old one's place.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "ckpt/checkpoint.h"
#include "ckpt/checkpoint_writer.h"
#include "core/checksum.h"
#include "core/error.h"
#include "core/files.h"

using origami::Checksum;
using origami::ParamSpec;
using origami::shard_runs;
using origami::ShardRun;

namespace {

// Creates directory `dir` (and its parents) holding `file` with `text`.
void dir_with_file(const std::filesystem::path& dir, const std::string& file, const std::string& text) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir / file) << text;
}

std::string bytes(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = char((i * 131 + 7) & 0xff);
  return s;
}

std::string sum(const std::string& s, const std::vector<size_t>& cuts) {
  Checksum c;
  size_t at = 0;
  for (size_t cut : cuts) {
    c.update(s.data() + at, cut - at);
    at = cut;
  }
  c.update(s.data() + at, s.size() - at);
  return c.hex();
}

}  // namespace

TEST(Checksum, SameForAnySplitOfTheStream) {
  const std::string s = bytes(1000);
  const std::string whole = sum(s, {});
  EXPECT_EQ(whole.size(), 16u);
  EXPECT_EQ(sum(s, {1}), whole);
  EXPECT_EQ(sum(s, {31, 32, 33, 500, 999}), whole);
  EXPECT_EQ(sum(s, {64, 96}), whole);
}

TEST(Checksum, AFlippedBitOrAShorterStreamChangesIt) {
  const std::string s = bytes(4096);
  const std::string whole = sum(s, {});
  for (size_t at : {size_t(0), size_t(31), size_t(2048), size_t(4095)}) {
    std::string t = s;
    t[at] = char(t[at] ^ 0x10);
    EXPECT_NE(sum(t, {}), whole) << "bit flipped at " << at;
  }
  EXPECT_NE(sum(s.substr(0, 4095), {}), whole);
  EXPECT_NE(sum(s + std::string(1, '\0'), {}), whole);  // a zero byte appended
}

// A tensor [R, K] split over TP on `dim` (optionally in `parts` blocks, padded): the TP ranks' shard
// runs cover each global element exactly once, and a piece [begin, end) of a shard maps to the
// same global elements as the whole shard's runs restricted to it.
void check_split(int dim, int parts, bool pad, int tp, int64_t R, int64_t K) {
  ParamSpec p;
  p.name = "w";
  p.shape = {R, K};
  p.split.dim = dim;
  p.split.parts = parts;
  p.split.pad = pad;
  std::vector<int> hits(size_t(R * K), 0);
  for (int r = 0; r < (dim < 0 ? 1 : tp); ++r) {  // a replicated tensor: every rank holds it all
    const int64_t n = p.local_numel(tp);
    std::vector<int64_t> global_of(size_t(n), -1);  // the shard's element → its global offset
    for (const ShardRun& run : shard_runs(p, tp, r, 0, n))
      for (int64_t i = 0; i < run.n; ++i) {
        global_of[size_t(run.local + i)] = run.global + i;
        ++hits[size_t(run.global + i)];
      }
    for (int64_t b : {int64_t(0), n / 3, n / 2})
      for (int64_t e : {n / 2 + 1, n - 1, n}) {
        if (e <= b) continue;
        int64_t last = -1, covered = 0, held = 0;  // held: the piece's elements that are not padding
        for (const ShardRun& run : shard_runs(p, tp, r, b, e)) {
          EXPECT_GE(run.local, 0);
          EXPECT_LE(run.local + run.n, e - b);
          EXPECT_GT(run.global, last);  // ascending in the global offset
          last = run.global + run.n - 1;
          covered += run.n;
          for (int64_t i = 0; i < run.n; ++i) EXPECT_EQ(global_of[size_t(b + run.local + i)], run.global + i);
        }
        for (int64_t i = b; i < e; ++i) held += global_of[size_t(i)] >= 0;
        EXPECT_EQ(covered, held) << "piece [" << b << ", " << e << ") of rank " << r;  // every one, once
      }
  }
  for (size_t i = 0; i < hits.size(); ++i) ASSERT_EQ(hits[i], 1) << "global element " << i;
}

TEST(ShardRuns, RowSplit) { check_split(0, 1, false, 2, 8, 5); }
TEST(ShardRuns, ColumnSplit) { check_split(1, 1, false, 4, 6, 8); }
TEST(ShardRuns, FusedBlocksSplitEach) { check_split(1, 3, false, 2, 4, 12); }
TEST(ShardRuns, PaddedVocabulary) { check_split(0, 1, true, 4, 257, 3); }
TEST(ShardRuns, Replicated) { check_split(-1, 1, false, 2, 3, 4); }

// Both ways of replacing a step directory: the atomic exchange (local file systems) and the two
// renames that file systems without RENAME_EXCHANGE (NFS, CephFS, Lustre) get: the new contents in
// the old name, nothing else left; a missing source is an error naming it, and the old directory stays.
TEST(ReplaceDir, ExchangeAndTwoRenames) {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / ("origami_test_replace_" + std::to_string(::getpid()));
  for (bool exchange : {true, false}) {
    fs::remove_all(root);
    dir_with_file(root / "step-4", "old", "old");
    dir_with_file(root / ".tmp-step-4", "new", "new");
    origami::replace_dir((root / ".tmp-step-4").string(), (root / "step-4").string(), exchange);
    EXPECT_TRUE(fs::exists(root / "step-4" / "new")) << exchange;
    EXPECT_FALSE(fs::exists(root / "step-4" / "old")) << exchange;
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(root)) names.push_back(e.path().filename().string());
    EXPECT_EQ(names, std::vector<std::string>{"step-4"}) << exchange;
    try {
      origami::replace_dir((root / "missing").string(), (root / "step-4").string(), exchange);
      ADD_FAILURE() << "no error for a missing source";
    } catch (const origami::Error& e) {
      EXPECT_NE(std::string(e.what()).find("missing"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(fs::exists(root / "step-4" / "new")) << "a failed replacement keeps the directory, " << exchange;
  }
  fs::remove_all(root);
}

// A crash between replace_dir's two renames leaves .step-N.replaced (the old step) and .step-N.tmp (the
// new one) and no step-N: the new one comes back where its metadata.json shows it whole, else the old.
// --keep-last's .step-M.old (a removal a crash may have cut short) is not brought back.
TEST(ReplaceDir, ACrashBetweenTheRenamesIsRepaired) {
  namespace fs = std::filesystem;
  const fs::path root = fs::temp_directory_path() / ("origami_test_restore_" + std::to_string(::getpid()));
  for (bool new_whole : {true, false}) {
    fs::remove_all(root);
    dir_with_file(root / ".step-4.replaced", "metadata.json", "old");
    dir_with_file(root / ".step-4.tmp", new_whole ? "metadata.json" : "rank-00000.safetensors", "new");
    dir_with_file(root / "step-2", "metadata.json", "2");
    dir_with_file(root / ".step-1.old", "metadata.json", "1");
    origami::restore_replaced_steps(root.string());
    std::string got;
    std::ifstream(root / "step-4" / "metadata.json") >> got;
    EXPECT_EQ(got, new_whole ? "new" : "old");
    EXPECT_TRUE(fs::exists(root / "step-2"));
    EXPECT_FALSE(fs::exists(root / "step-1")) << "a step --keep-last was removing came back";
    origami::restore_replaced_steps(root.string());  // nothing left to do: no change, no error
    EXPECT_TRUE(fs::exists(root / "step-4" / "metadata.json"));
  }
  fs::remove_all(root);
}
