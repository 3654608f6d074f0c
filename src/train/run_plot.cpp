#include "train/run_plot.h"

#include <cmath>
#include <filesystem>
#include <map>
#include <sstream>

#include "core/error.h"
#include "core/gnuplot.h"
#include "train/metrics_file.h"

namespace origami {

namespace {

const char* x_label(PlotX x) {
  switch (x) {
    case PlotX::step: return "step";
    case PlotX::tokens: return "tokens";
    case PlotX::time: return "training time (s)";
  }
  return "";
}

// One datablock per run ($runI: x, loss, lr, tokens/s, grad norm) and per run with validation ($valI).
void write_data(std::ostringstream& s, const std::vector<RunCurves>& runs) {
  for (size_t i = 0; i < runs.size(); ++i) {
    const RunCurves& r = runs[i];
    s << "$run" << i << " << EOD\n";
    for (size_t k = 0; k < r.x.size(); ++k)
      s << r.x[k] << ' ' << r.loss[k] << ' ' << r.lr[k] << ' ' << r.tokens_per_s[k] << ' ' << r.grad_norm[k] << '\n';
    s << "EOD\n";
    if (r.val_x.empty()) continue;
    s << "$val" << i << " << EOD\n";
    for (size_t k = 0; k < r.val_x.size(); ++k) s << r.val_x[k] << ' ' << r.val_loss[k] << '\n';
    s << "EOD\n";
  }
}

// One panel: column `col` of every run; the loss panel also the validation points and the legend.
void write_panel(std::ostringstream& s, const std::vector<RunCurves>& runs, const char* title, int col, bool loss) {
  s << "set title '" << title << "'\n" << (loss ? "set logscale y\n" : "unset logscale y\n") << "plot";
  for (size_t i = 0; i < runs.size(); ++i) {
    s << (i ? ", \\\n    " : " ") << "$run" << i << " using 1:" << col
      << (runs[i].x.size() > 1 ? " with lines lw 2" : " with points pt 7")  // (one point draws no line)
      << " lc rgb '"
      << series_colour(i) << "' " << (loss ? "title " + gnuplot_quoted(runs[i].label) : std::string("notitle"));
    if (loss && !runs[i].val_x.empty())
      s << ", \\\n    $val" << i << " using 1:2 with points pt 7 ps 1.2 lc rgb '" << series_colour(i) << "' title "
        << gnuplot_quoted(runs[i].label + " (validation)");
  }
  s << "\n";
}

}  // namespace

PlotX parse_plot_x(const std::string& s) {
  if (s == "step") return PlotX::step;
  if (s == "tokens") return PlotX::tokens;
  if (s == "time") return PlotX::time;
  throw Error(cat("--x '", s, "' is not one of step, tokens, time"));
}

RunCurves read_run_curves(const std::string& path, PlotX x) {
  RunCurves c;
  const std::vector<MetricsRow> rows = read_metrics_rows(path);
  // A resumed run cuts the rows past its checkpoint's step before it appends (MetricsFile), so a step
  // has one row; files written before that rule can hold a step twice, and its last row is the run's.
  std::map<double, size_t> last;
  for (size_t i = 0; i < rows.size(); ++i) {
    const double step = metrics_number(rows[i], "step");
    ORIGAMI_CHECK(std::isfinite(step), rows[i].where, ": \"step\" is not a number");  // (null reads as NaN)
    last[step] = i;
  }
  double seconds = 0, tokens = 0;
  // A file that starts mid-run (a resume into a new --metrics file): the steps before its first as
  // many tokens as that step's own (exact for windows; under document batching an estimate), so the
  // run sits where it trained on the tokens axis. (The time axis has no such record: from 0.)
  if (!last.empty() && last.begin()->first > 1)
    tokens = (last.begin()->first - 1) * metrics_number(rows[last.begin()->second], "tokens");
  for (const auto& [step, i] : last) {
    const MetricsRow& r = rows[i];
    seconds += metrics_number(r, "ms") / 1000;
    tokens += metrics_number(r, "tokens");  // (a step's own: under document batching they differ)
    const double at = x == PlotX::step ? step : x == PlotX::tokens ? tokens : seconds;
    // (validation after a skipped step measured the model as the step left it, which is the model's)
    if (r.row.contains("val_loss") && r.row["val_loss"].is_number())  // (a NaN validation loss is null)
      c.val_x.push_back(at), c.val_loss.push_back(metrics_number(r, "val_loss"));
    if (r.row.contains("skipped")) continue;  // no update: its loss is not the model's (NaN, or no token)
    c.x.push_back(at);
    c.loss.push_back(metrics_number(r, "loss"));
    c.lr.push_back(metrics_number(r, "lr"));
    c.tokens_per_s.push_back(metrics_number(r, "tokens_per_s"));
    c.grad_norm.push_back(metrics_number(r, "grad_norm"));
    if (c.label.empty() && r.row.contains("layout") && r.row["layout"].is_string())
      c.label = cat(std::filesystem::path(path).filename().string(), ": ", r.row["layout"].get<std::string>());
  }
  ORIGAMI_CHECK(!c.x.empty(), "'", path, "' has no metrics rows", last.empty() ? "" : " of a step that updated the "
                "model (every step was skipped)");
  if (c.label.empty()) c.label = std::filesystem::path(path).filename().string();
  return c;
}

void plot_runs(const std::vector<RunCurves>& runs, PlotX x, const std::string& png_path) {
  ORIGAMI_ASSERT(!runs.empty());
  std::ostringstream s;
  s.precision(9);
  write_data(s, runs);
  s << "set terminal pngcairo size 1400,900 font 'sans,11' noenhanced\n"  // text as typed
    << "set multiplot layout 2,2\n"
    << "set grid\n"
    << "set key top right font ',9'\n"
    << "set xlabel '" << x_label(x) << "'\n";
  write_panel(s, runs, "loss", 2, true);
  write_panel(s, runs, "learning rate", 3, false);
  write_panel(s, runs, "tokens/s", 4, false);
  write_panel(s, runs, "gradient norm", 5, false);
  s << "unset multiplot\n";
  render_png(s.str(), png_path, "plot");
}

}  // namespace origami
