// The metrics file as a resumed run leaves it (train/metrics.h MetricsFile) and as origami plot reads
// it (train/run_plot.h read_run_curves). (tests/parallel/test_watching.py runs a real resume.)
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "core/files.h"
#include "train/metrics.h"
#include "train/run_plot.h"

using namespace origami;

namespace {

std::string temp_file(const std::string& name, const std::string& text) {
  const std::string path =
      (std::filesystem::temp_directory_path() / ("origami_metrics_" + std::to_string(::getpid()) + "_" + name)).string();
  std::ofstream(path, std::ios::trunc) << text;
  return path;
}

}  // namespace

// A resume from step 2: the file is cut before the dead attempt's first row past it (step 3), its cut
// last row with the rest; what came before stays byte for byte, and the file stays where a link points.
TEST(MetricsFile, AResumeDropsTheRowsPastItsCheckpoint) {
  const std::string path = temp_file("resume.jsonl", "{\"step\": 1, \"loss\": 5.0}\n{\"step\": 2, \"loss\": 4.0}\n"
                                                     "{\"note\": \"kept\"}\n{\"step\": 3, \"loss\": 3.0}\n"
                                                     "{\"step\": 4, \"loss\": 2.0}\n{\"step\": 5, \"lo");
  const std::string link = path + ".link";
  std::filesystem::remove(link);
  std::filesystem::create_symlink(path, link);
  {
    MetricsFile f(link, true, "metrics file", 2);
    EXPECT_TRUE(f.write({{"step", 3}, {"loss", 3.5}}));
  }
  EXPECT_TRUE(std::filesystem::is_symlink(link));
  EXPECT_EQ(read_file_bytes(path), "{\"step\": 1, \"loss\": 5.0}\n{\"step\": 2, \"loss\": 4.0}\n{\"note\": \"kept\"}\n"
                                   "{\"loss\":3.5,\"step\":3}\n");
  std::filesystem::remove(link);
  std::filesystem::remove(path);
}

// origami plot: a skipped step draws no loss point, but its validation (of the model as the step left
// it) is drawn; a step written twice (an older file's resume) counts once, with its last row.
TEST(RunCurves, SkippedStepsKeepTheirValidationAndRepeatedStepsCountOnce) {
  const std::string path = temp_file(
      "plot.jsonl",
      "{\"step\": 1, \"loss\": 5.0, \"lr\": 0.1, \"tokens_per_s\": 10, \"grad_norm\": 1, \"ms\": 1000, \"tokens\": 8}\n"
      "{\"step\": 2, \"loss\": 9.0, \"lr\": 0.1, \"tokens_per_s\": 10, \"grad_norm\": 1, \"ms\": 1000, \"tokens\": 8}\n"
      "{\"step\": 2, \"loss\": null, \"skipped\": true, \"val_loss\": 4.5, \"lr\": 0.1, \"tokens_per_s\": 10, "
      "\"grad_norm\": null, \"ms\": 1000, \"tokens\": 8}\n"
      "{\"step\": 3, \"loss\": 4.0, \"lr\": 0.1, \"tokens_per_s\": 10, \"grad_norm\": 1, \"ms\": 1000, \"tokens\": 8}\n");
  const RunCurves c = read_run_curves(path, PlotX::tokens);
  EXPECT_EQ(c.x, (std::vector<double>{8, 24}));
  EXPECT_EQ(c.loss, (std::vector<double>{5.0, 4.0}));
  EXPECT_EQ(c.val_x, (std::vector<double>{16}));
  EXPECT_EQ(c.val_loss, (std::vector<double>{4.5}));
  std::filesystem::remove(path);
}

// A file that starts mid-run (a resume into a new --metrics file) sits where its steps trained on the
// tokens axis: its first step, 11, after 10 steps of that step's tokens (it started at one step's).
TEST(RunCurves, AFileThatStartsMidRunStartsAtItsTokens) {
  const std::string path = temp_file(
      "resumed.jsonl",
      "{\"step\": 11, \"loss\": 3.0, \"lr\": 0.1, \"tokens_per_s\": 10, \"grad_norm\": 1, \"ms\": 1000, \"tokens\": 8}\n"
      "{\"step\": 12, \"loss\": 2.9, \"lr\": 0.1, \"tokens_per_s\": 10, \"grad_norm\": 1, \"ms\": 1000, \"tokens\": 8}\n");
  EXPECT_EQ(read_run_curves(path, PlotX::tokens).x, (std::vector<double>{88, 96}));
  EXPECT_EQ(read_run_curves(path, PlotX::step).x, (std::vector<double>{11, 12}));
  std::filesystem::remove(path);
}
