// origami plot: draw the curves of runs from their --metrics files (train/run_plot.h).
#include <cstdio>
#include <string>
#include <vector>

#include "commands.h"
#include "core/args.h"
#include "core/error.h"
#include "core/gnuplot.h"
#include "train/run_plot.h"

namespace origami {

int cmd_plot(int argc, char** argv) {
  Args a("plot METRICS.jsonl [MORE.jsonl ...]",
         "Draw the curves of one or more runs from the JSONL files `origami train --metrics` writes: loss (and\n"
         "validation loss) on a log scale, learning rate, tokens/s and gradient norm, one colour per run\n"
         "labelled with its file and layout. Needs gnuplot.");
  a.option("out", "FILE.png", "the picture to write (replaced atomically)")
      .option("x", "step|tokens|time", "the horizontal axis: steps, tokens trained, or training time (the sum of "
                                       "the steps' times)", "step");
  std::vector<std::string> files;  // the leading words that are not options
  while (argc >= 2 && argv[1][0] != '-') {
    files.push_back(argv[1]);
    argv[1] = argv[0];
    --argc, ++argv;
  }
  if (!a.parse(argc, argv)) return 0;
  ORIGAMI_CHECK(!files.empty(), "give one or more metrics files: origami plot RUN.jsonl [MORE.jsonl ...] --out FILE.png");
  ORIGAMI_CHECK(a.has("out"), "give the picture to write: --out FILE.png");
  require_png_output(a.str("out"), "--out", "plot writes");
  const PlotX x = parse_plot_x(a.str("x"));
  require_gnuplot("plot");
  std::vector<RunCurves> runs;
  for (const std::string& f : files) runs.push_back(read_run_curves(f, x));
  plot_runs(runs, x, a.str("out"));
  size_t points = 0;
  for (const RunCurves& r : runs) points += r.x.size();
  std::printf("wrote %s: %zu run%s, %zu steps\n", a.str("out").c_str(), runs.size(), runs.size() == 1 ? "" : "s", points);
  return 0;
}

}  // namespace origami
