#include "core/args.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/json_fields.h"

namespace origami {

Args::Args(std::string command, std::string summary)
    : command_(std::move(command)), summary_(std::move(summary)) {}

Args& Args::option(const std::string& name, const std::string& metavar, const std::string& help,
                   const std::string& default_value) {
  order_.push_back(name);
  Opt& o = opts_[name] = Opt{};
  o.metavar = metavar, o.help = help, o.value = default_value;
  return *this;
}

Args& Args::allow_empty() {
  opts_[order_.back()].empty_ok = true;
  return *this;
}

Args& Args::flag(const std::string& name, const std::string& help) {
  order_.push_back(name);
  Opt& o = opts_[name] = Opt{};
  o.help = help, o.is_flag = true;
  return *this;
}

namespace {
// The items of a comma-separated list, an empty one after a trailing comma kept ("2,2," is 3 items).
std::vector<std::string> comma_items(const std::string& s) {
  std::vector<std::string> out;
  size_t at = 0;
  for (size_t comma; (comma = s.find(',', at)) != std::string::npos; at = comma + 1) out.push_back(s.substr(at, comma - at));
  out.push_back(s.substr(at));
  return out;
}

// A number as an option's value spells it: digits, a sign, a point and an exponent only — no blanks
// (which strtod and strtoll would skip), no hex ("0x10", "0x1p3"), no "inf" or "nan".
bool decimal_text(const std::string& s) {
  return !s.empty() && s.find_first_not_of("0123456789+-.eE") == std::string::npos;
}

// An item of a list without the blanks around it ("2, 2" is the list 2,2).
std::string trimmed(const std::string& s) {
  const size_t first = s.find_first_not_of(' ');
  return first == std::string::npos ? std::string() : s.substr(first, s.find_last_not_of(' ') - first + 1);
}

// Whether two list items, without the blanks around them (as integers() reads them), are one number:
// compared as integers where both are (exactly, beyond 2^53 too), else as decimal numbers; other text
// (hex and infinities included, which no option reads as numbers) is not a number.
bool same_number(const std::string& x_item, const std::string& y_item) {
  const std::string x = trimmed(x_item), y = trimmed(y_item);
  if (!decimal_text(x) || !decimal_text(y)) return false;
  char *end_x = nullptr, *end_y = nullptr;
  errno = 0;
  const long long i = std::strtoll(x.c_str(), &end_x, 10), j = std::strtoll(y.c_str(), &end_y, 10);
  if (*end_x == 0 && *end_y == 0 && errno == 0) return i == j;
  const double a = std::strtod(x.c_str(), &end_x), b = std::strtod(y.c_str(), &end_y);
  return *end_x == 0 && *end_y == 0 && a == b;
}

// Two spellings of one value: equal strings, the same number (2 and 2.0, 1e-3 and 0.001), or
// comma-separated lists ("2,2" and "2, 2", as integers() reads them) whose items are so item by item.
bool same_value(const std::string& a, const std::string& b) {
  if (a == b) return true;
  const std::vector<std::string> xs = comma_items(a), ys = comma_items(b);
  if (xs.size() != ys.size()) return false;
  for (size_t i = 0; i < xs.size(); ++i)
    if (xs[i] != ys[i] && !same_number(xs[i], ys[i])) return false;
  return true;
}
}  // namespace

// Edits (insertions, deletions, substitutions, swaps of neighbours) that turn a into b.
static size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i)
    for (size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1])});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

std::string closest_name(const std::string& got, const std::vector<std::string>& names) {
  if (got.empty()) return "";
  const size_t most = std::min<size_t>(2, std::max<size_t>(1, got.size() / 4));
  std::string best, prefixed;
  size_t best_d = most + 1, starts = 0;
  for (const std::string& n : names) {
    const size_t d = edit_distance(got, n);
    if (d < best_d) best_d = d, best = n;
    if (n.rfind(got, 0) == 0) ++starts, prefixed = n;
  }
  return !best.empty() ? best : starts == 1 ? prefixed : "";
}

// " (did you mean --steps?)" for a name close to one of `names`, else "".
static std::string did_you_mean(const std::string& got, const std::vector<std::string>& names, const char* before,
                                const char* after) {
  const std::string n = closest_name(got, names);
  return n.empty() ? "" : cat(" (did you mean ", before, n, after, "?)");
}

bool Args::parse(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(help().c_str(), stdout);
      return false;
    }
    ORIGAMI_CHECK(a.rfind("--", 0) == 0, "unexpected argument '", a,
                  "' (options start with --; see --help)");
    std::string name = a.substr(2), value;
    auto eq = name.find('=');
    bool inline_value = eq != std::string::npos;
    if (inline_value) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    auto it = opts_.find(name);
    ORIGAMI_CHECK(it != opts_.end(), "unknown option --", name, did_you_mean(name, order_, "--", ""), " (see --help)");
    Opt& o = it->second;
    if (o.is_flag) {
      ORIGAMI_CHECK(!inline_value, "--", name, " takes no value");
      value.assign(1, '1');  // (not = "1": GCC 12 warns of a false -Wrestrict overlap there)
    } else if (!inline_value) {
      ORIGAMI_CHECK(i + 1 < argc, "--", name, " needs a value (", o.metavar, ")");
      value = argv[++i];
      // Another of this command's options in a value's place ("--metrics --quiet") is a forgotten value:
      // taken as one, a file of that name would be written and the option dropped (--NAME=VALUE takes any).
      const std::string next = value.rfind("--", 0) == 0 ? value.substr(2, value.find('=') - 2) : "";
      ORIGAMI_CHECK(next.empty() || (!opts_.count(next) && next != "help"), "--", name, " needs a value (", o.metavar,
                    "), got the option ", value, " (a value that starts with -- goes as --", name, "=VALUE)");
    }
    ORIGAMI_CHECK(o.is_flag || o.empty_ok || !value.empty(), "--", name, " needs a value (", o.metavar,
                  "), got an empty one");
    // (one of two values would be ignored: as a run config's key against a plan's, an error)
    ORIGAMI_CHECK(!o.set || same_value(value, o.value), "--", name, " is given twice, as '", o.value, "' and as '",
                  value, "': the last would win and the first be ignored; give it once");
    o.value = value;
    o.set = true;
  }
  return true;
}


void Args::fill_from_json(const JsonField& obj) {
  obj.for_each_member([&](const std::string& key, const JsonField& val) {
    auto it = opts_.find(key);
    ORIGAMI_CHECK(it != opts_.end(), obj.file(), ": unknown key '", key, "'", did_you_mean(key, order_, "'", "'"),
                  " (the keys are the options of '",
                  command_, " --help' without the leading --)");
    Opt& o = it->second;
    // The file's value, of its option's type whether or not it is used (a broken file is found now,
    // not once a flag that hid it is dropped).
    std::string value;
    if (o.is_flag) value = val.boolean() ? "1" : "";
    else if (val.present() && val.json().is_string() && (o.empty_ok || !val.string().empty())) value = val.string();
    else if (val.present() && val.json().is_string()) val.fail_expected("a non-empty string");
    else if (val.present() && val.json().is_number()) value = val.json().dump();
    else val.fail_expected("a string or a number");
    if (o.set) {  // flags win; an earlier file (a plan before a run config) wins too, but not silently
      ORIGAMI_CHECK(o.origin.empty() || same_value(value, o.value), val.where(), " gives ", val.got(), ", and ", o.origin,
                    " gives ", o.given, ": the first wins, so this one would be ignored; drop one, or give --", key,
                    " on the command line");
      return;
    }
    o.value = value;
    o.origin = val.where();
    o.given = val.got();
    o.set = true;
  });
}

const Args::Opt& Args::get(const std::string& name) const {
  auto it = opts_.find(name);
  ORIGAMI_ASSERT(it != opts_.end());
  return it->second;
}

bool Args::has(const std::string& name) const { return !get(name).value.empty(); }
bool Args::given(const std::string& name) const { return get(name).set; }
std::string Args::str(const std::string& name) const { return get(name).value; }
bool Args::on(const std::string& name) const { return has(name) && get(name).value != "0"; }

int64_t Args::integer(const std::string& name) const {
  const std::string& v = get(name).value;
  char* end = nullptr;
  errno = 0;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (!decimal_text(v) || *end != 0) bad_value(name, "an integer");
  // (the side the value left by: a large --ep is not told that -2^63 would do)
  if (errno == ERANGE)
    bad_value(name, x < 0 ? "an integer of at least -9223372036854775808" : "an integer of at most 9223372036854775807");
  return x;
}

uint64_t Args::unsigned_integer(const std::string& name) const {
  const std::string& v = get(name).value;
  char* end = nullptr;
  errno = 0;
  const unsigned long long x = std::strtoull(v.c_str(), &end, 10);  // (which would take "-1" as 2^64 - 1)
  if (v.empty() || !std::isdigit(static_cast<unsigned char>(v[0])) || *end != 0 || errno == ERANGE)
    bad_value(name, "an integer in [0, 18446744073709551615]");
  return x;
}

int Args::small_integer(const std::string& name) const {
  const int64_t x = integer(name);
  if (x < INT32_MIN) bad_value(name, "an integer of at least -2147483648");
  if (x > INT32_MAX) bad_value(name, "an integer of at most 2147483647");
  return int(x);
}

std::vector<int64_t> Args::integers(const std::string& name) const {
  const std::string& v = get(name).value;
  std::vector<int64_t> out;
  for (const std::string& raw : comma_items(v)) {
    const std::string item = trimmed(raw);
    char* end = nullptr;
    errno = 0;
    const long long x = std::strtoll(item.c_str(), &end, 10);
    if (!decimal_text(item) || *end != 0 || errno == ERANGE) bad_value(name, "comma-separated integers (like 5,6,6,5)");
    out.push_back(x);
  }
  return out;
}

double Args::number(const std::string& name) const {
  const std::string& v = get(name).value;
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (!decimal_text(v) || *end != 0 || !std::isfinite(x)) bad_value(name, "a number");
  return x;
}

std::string Args::source(const std::string& name) const {
  const Opt& o = get(name);
  return o.origin.empty() ? cat("--", name) : o.origin;
}

void Args::bad_value(const std::string& name, const char* what) const {
  const Opt& o = get(name);
  if (!o.origin.empty()) fail(o.origin, ": expected ", what, ", got ", o.given);  // from a run-config or plan file
  fail("--", name, " must be ", what, ", got '", o.value, "'");
}

std::string Args::help() const {
  std::string s = "usage: origami " + command_ + " [options]\n\n" + summary_ + "\n\noptions:\n";
  for (const auto& name : order_) {
    const Opt& o = opts_.at(name);
    std::string left = "  --" + name + (o.is_flag ? "" : " " + o.metavar);
    if (left.size() < 30) left.resize(30, ' ');
    else left += "\n" + std::string(30, ' ');
    s += left + o.help;
    // (a help text that says its default in words keeps them: "(default: all cores)", not also "(default 0)")
    if (!o.is_flag && !o.value.empty() && o.help.find("(default") == std::string::npos) s += " (default " + o.value + ")";
    s += "\n";
  }
  s += "  --help                      show this help\n";
  return s;
}

}  // namespace origami
