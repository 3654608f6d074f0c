// The plot of `origami plan --plot FILE.png`: the predicted step time of layouts, by part, drawn by
// gnuplot (core/gnuplot.h).
#pragma once
#include <map>
#include <string>
#include <vector>

namespace origami {

// One layout's bar: the parts of Prediction (plan/cost_model.h) its step time is the sum of.
struct PlotRow {
  std::string label;                         // the layout
  double compute_s = 0, bubble_s = 0;
  std::map<std::string, double> exposed_s;   // per communicator (Prediction::exposed_s)
};

// Writes a PNG of one horizontal stacked bar per row, top to bottom in the order given: compute,
// bubble and the exposed time of each communicator (a part that is zero in every row is left
// out), each bar labelled with its total; `title` above. The PNG replaces `png_path` atomically
// (written to png_path + ".tmp", then renamed). Error when gnuplot is not installed, when it
// fails (its last error line), or when png_path cannot be written.
void plot_step_breakdown(const std::vector<PlotRow>& rows, const std::string& title, const std::string& png_path);

}  // namespace origami
