// Pictures drawn by gnuplot (Debian's gnuplot-nox, its pngcairo terminal), which origami runs as a
// child process: `origami plan --plot` (plan/plot.h) and `origami plot` (train/run_plot.h).
#pragma once
#include <string>

namespace origami {

// Error unless an executable gnuplot is on the PATH; `who` names the option or command asking
// ("--plot", "plot"), which asks before its work, not after it.
void require_gnuplot(const std::string& who);

// Error unless `png_path`, given as `option`, names a PNG file this process can write (a .png name,
// require_writable_file), before any work: "OPTION 'PATH': WHAT a PNG picture, so FILE.png".
void require_png_output(const std::string& png_path, const std::string& option, const std::string& what);

// Runs the gnuplot `script` (which must not set an output: the PNG is its standard output) and
// replaces `png_path` with the picture atomically (written to png_path + ".tmp", then renamed).
// Error when gnuplot is not installed, when it fails (its last error line), or when png_path cannot
// be written; `who` begins each message.
void render_png(const std::string& script, const std::string& png_path, const std::string& who);

// Text for a script: control characters (which would end a line of it) become spaces; and a
// single-quoted gnuplot string of it, in which nothing is an escape but a doubled quote.
std::string one_line(std::string s);
std::string gnuplot_quoted(const std::string& s);

// Paul Tol's qualitative colours (told apart with colour-blindness too), as "#RRGGBB", for the i-th
// series (cycling).
const char* series_colour(size_t i);

}  // namespace origami
