#include "plan/plot.h"

#include <algorithm>
#include <sstream>

#include "core/error.h"
#include "core/gnuplot.h"

namespace origami {
namespace {

// One segment kind of the bars: its legend entry, colour and seconds in each row.
struct Part {
  std::string name, colour;
  std::vector<double> s;
};

// Compute in the first series colour, the bubble grey, then the communicators in the next colours.
constexpr const char* kBubbleColour = "#BBBBBB";

// compute; bubble unless it is zero in every row; then each communicator with exposed time in some
// row, by name.
std::vector<Part> parts_of(const std::vector<PlotRow>& rows) {
  std::vector<Part> parts{{"compute", series_colour(0), {}}, {"bubble", kBubbleColour, {}}};
  std::map<std::string, size_t> axes;  // communicator -> its index in parts
  for (const PlotRow& r : rows)
    for (const auto& [axis, s] : r.exposed_s)
      if (s > 0) axes.emplace(axis, 0);
  size_t colour = 0;
  for (auto& [axis, index] : axes) {
    index = parts.size();
    parts.push_back({"exposed " + axis, series_colour(1 + colour++), {}});
  }
  for (const PlotRow& r : rows) {
    for (Part& p : parts) p.s.push_back(0);
    parts[0].s.back() = r.compute_s;
    parts[1].s.back() = r.bubble_s;
    for (const auto& [axis, s] : r.exposed_s)
      if (axes.count(axis)) parts[axes[axis]].s.back() = s;
  }
  if (std::all_of(parts[1].s.begin(), parts[1].s.end(), [](double s) { return s == 0; }))
    parts.erase(parts.begin() + 1);
  return parts;
}

// The gnuplot script, its data inline: per row the label, then where each part starts and ends along
// the bar (columns k + 2 and k + 3 for part k). Row i is drawn at y = i, the first at the top: its
// label above its bar, so that long layout names leave the whole width to the bars.
std::string script(const std::vector<PlotRow>& rows, const std::vector<Part>& parts, const std::string& title) {
  std::ostringstream s;
  s.precision(9);
  s << "$bars << EOD\n";
  double longest = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    double x = 0;
    s << one_line(rows[r].label) << '\t' << x;
    for (const Part& p : parts) s << '\t' << (x += p.s[r]);
    s << '\n';
    longest = std::max(longest, x);
  }
  s << "EOD\n";
  s << "set terminal pngcairo size 1200," << 160 + 60 * rows.size() << " font 'sans,11' noenhanced\n"  // text as typed
    << "set datafile separator '\\t'\n"
    << "set title " << gnuplot_quoted(title) << " font ',13'\n"
    << "set xlabel 'seconds per step'\n"
    << "set xrange [0:" << longest * 1.1 << "]\n"  // room for the totals right of the bars
    << "set xtics nomirror\n"
    << "set grid xtics\n"
    << "set yrange [" << rows.size() - 0.5 << ":-0.5]\n"
    << "unset ytics\n"
    << "set lmargin 3\n"
    << "set rmargin 3\n"
    << "set key outside bottom center horizontal Left reverse samplen 2 height 1\n"  // height: clear of the xlabel
    << "set style fill solid 1.0 noborder\n"
    << "plot";
  for (size_t k = 0; k < parts.size(); ++k)
    s << (k ? ", \\\n    " : " ") << "$bars using " << k + 2 << ":0:" << k + 2 << ":" << k + 3
      << ":($0-0.08):($0+0.4) with boxxyerror lc rgb '" << parts[k].colour << "' title " << gnuplot_quoted(parts[k].name);
  const size_t total = parts.size() + 2;
  s << ", \\\n    $bars using " << total << ":($0+0.16):(sprintf(' %.4g s', column(" << total
    << "))) with labels left notitle"
    << ", \\\n    $bars using (0):($0-0.28):1 with labels left offset 0.5,0 notitle\n";
  return s.str();
}

}  // namespace

void plot_step_breakdown(const std::vector<PlotRow>& rows, const std::string& title, const std::string& png_path) {
  ORIGAMI_ASSERT(!rows.empty());
  render_png(script(rows, parts_of(rows), title), png_path, "--plot");
}

}  // namespace origami
