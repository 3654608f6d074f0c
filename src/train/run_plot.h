// `origami plot`: the curves of one or more runs from their --metrics files, drawn by gnuplot
// (core/gnuplot.h) in four panels — loss (and validation loss) on a log scale, learning rate,
// tokens/s and gradient norm — one colour per run, labelled with its file and layout.
#pragma once
#include <string>
#include <vector>

namespace origami {

enum class PlotX { step, tokens, time };
PlotX parse_plot_x(const std::string& s);  // "step" | "tokens" | "time"; else an Error naming the value

// One run's series. x: the step, the tokens trained (the steps' tokens summed; a file that starts at
// step s > 1 counts s − 1 steps of its first step's tokens before it) or the training time so far (the
// sum of the file's steps' ms, in seconds).
struct RunCurves {
  std::string label;  // "FILE: layout"
  std::vector<double> x, loss, lr, tokens_per_s, grad_norm;
  std::vector<double> val_x, val_loss;  // the steps that evaluated
};

// Reads a metrics file (one JSON object per line). A last line cut short (a killed run) and the
// steps whose update was skipped ("skipped": a non-finite step, or one with no token to predict) are
// left out; Error naming the file when it is missing or unreadable, has no rows, or has a line that is
// not a metrics row (naming the line).
RunCurves read_run_curves(const std::string& metrics_path, PlotX x);

// The PNG of the runs' curves (render_png: atomic, Error when gnuplot is missing or fails).
void plot_runs(const std::vector<RunCurves>& runs, PlotX x, const std::string& png_path);

}  // namespace origami
