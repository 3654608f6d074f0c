#include "core/json_fields.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <set>
#include <string>
#include <vector>
#include <utility>

#include "core/error.h"
#include "core/files.h"

namespace origami {

int json_depth(std::string_view text) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

nlohmann::json parse_json_keys_once(std::string_view text, const std::string& label) {
  using Event = nlohmann::json::parse_event_t;
  std::vector<std::set<std::string>> keys;  // of each object open, outermost first
  std::vector<std::string> path;            // the key under way in each object open
  const auto on_event = [&](int, Event event, nlohmann::json& parsed) {
    if (event == Event::object_start) keys.emplace_back(), path.emplace_back();
    if (event == Event::object_end) keys.pop_back(), path.pop_back();
    if (event == Event::key) {
      const std::string& key = parsed.get_ref<const std::string&>();
      std::string where;
      for (size_t i = 0; i + 1 < path.size(); ++i) where += (where.empty() ? "" : ".") + path[i];
      ORIGAMI_CHECK(keys.back().insert(key).second, label, ": gives '", key, "' twice in one object (at ",
                    where.empty() ? "the top level" : "'" + where + "'",
                    "): the last would win and the first be ignored; give it once");
      path.back() = key;
    }
    return true;
  };
  return nlohmann::json::parse(text.begin(), text.end(), on_event);
}

nlohmann::json parse_json(std::string_view text, const std::string& file) {
  const int depth = json_depth(text);
  ORIGAMI_CHECK(depth <= kMaxJsonDepth, file, ": nests arrays and objects ", depth, " levels deep; origami reads at most ",
                kMaxJsonDepth);
  try {
    return parse_json_keys_once(text, file);
  } catch (const nlohmann::json::exception& e) {  // parse_error, or out_of_range for a number past double's range
    fail(file, ": not valid JSON (", e.what(), ")");
  }
}

nlohmann::json parse_json_file(const std::string& path) { return parse_json(read_file_bytes(path), path); }

bool NumberRange::holds(double x) const {
  return std::isfinite(x) && (lo_open ? x > lo : x >= lo) && x <= hi;
}

std::string NumberRange::describe() const {
  if (hi == kMax) {
    if (lo == -kMax) return "a number";
    if (lo == 0) return lo_open ? "a positive number" : "a non-negative number";
    return cat("a number ", lo_open ? ">" : ">=", " ", lo);
  }
  return cat("a number in ", lo_open ? "(" : "[", lo, ", ", hi, "]");
}

std::string describe_integer_range(int64_t lo, int64_t hi) {
  if (hi == JsonField::kNoLimit) {
    if (lo == 1) return "a positive integer";
    if (lo == 0) return "a non-negative integer";
    return cat("an integer >= ", lo);
  }
  return cat("an integer in [", lo, ", ", hi, "]");
}

namespace {

// A key a path may show bare: letters, digits, '_' and '-'.
bool is_plain_word(std::string_view key) {
  if (key.empty()) return false;
  for (char c : key)
    if (!(std::isalnum((unsigned char)c) || c == '_' || c == '-')) return false;
  return true;
}

// JSON text of a value; invalid UTF-8 (possible only in values built in code, not in parsed
// ones) is replaced rather than thrown on.
std::string dump(const nlohmann::json& j) { return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace); }

}  // namespace

JsonField::JsonField(const nlohmann::json& root, std::string file)
    : value_(&root), file_(std::make_shared<const std::string>(std::move(file))) {}

std::string JsonField::name() const {
  switch (kind_) {
    case kRoot: return "";
    case kMember:
      if (is_plain_word(key_)) return parent_.empty() ? key_ : parent_ + "." + key_;
      return parent_ + "[" + dump(key_) + "]";
    case kElement: return parent_ + "[" + std::to_string(index_) + "]";
  }
  return "";
}

JsonField JsonField::operator[](std::string_view key) const {
  const nlohmann::json* v = nullptr;
  if (present()) {
    object();
    auto it = value_->find(key);
    v = it == value_->end() ? nullptr : &*it;
  }
  return JsonField(v, file_, name(), std::string(key));
}

JsonField JsonField::operator[](size_t index) const {
  const nlohmann::json* v = nullptr;
  if (present()) {
    array();
    v = index < value_->size() ? &(*value_)[index] : nullptr;
  }
  return JsonField(v, file_, name(), index);
}

std::string JsonField::where() const { return kind_ == kRoot ? file() : cat(file(), ": field '", name(), "'"); }

std::string JsonField::got() const {
  std::string s = value_ ? dump(*value_) : "nothing";
  constexpr size_t kShown = 60;
  if (s.size() <= kShown) return s;
  size_t cut = kShown - 3;
  while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xC0) == 0x80) --cut;  // not inside a UTF-8 character
  return s.substr(0, cut) + "...";
}

void JsonField::fail_expected(std::string_view what) const { fail(where(), ": expected ", what, ", got ", got()); }

void JsonField::fail_missing() const { fail(where(), ": missing"); }

const nlohmann::json& JsonField::required() const {
  if (!value_) fail_missing();
  return *value_;
}

int64_t JsonField::integer(int64_t lo, int64_t hi) const {
  const nlohmann::json& v = required();
  // The parser keeps a non-negative integer as unsigned, one beyond 64 bits as a double.
  bool ok = false;
  int64_t x = 0;
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    ok = u <= uint64_t(kNoLimit) && int64_t(u) >= lo && int64_t(u) <= hi;
    x = int64_t(u);
  } else if (v.is_number_integer()) {
    x = v.get<int64_t>();
    ok = x >= lo && x <= hi;
  }
  if (!ok) fail_expected(describe_integer_range(lo, hi));
  return x;
}

double JsonField::number(NumberRange range) const {
  const nlohmann::json& v = required();
  if (!v.is_number() || !range.holds(v.get<double>())) fail_expected(range.describe());
  return v.get<double>();
}

bool JsonField::boolean() const {
  const nlohmann::json& v = required();
  if (!v.is_boolean()) fail_expected("true or false");
  return v.get<bool>();
}

const std::string& JsonField::string() const {
  const nlohmann::json& v = required();
  if (!v.is_string()) fail_expected("a string");
  return v.get_ref<const std::string&>();
}

size_t JsonField::one_of(std::initializer_list<std::string_view> choices) const {
  const nlohmann::json& v = required();
  size_t i = 0;
  if (v.is_string())
    for (std::string_view c : choices) {
      if (v.get_ref<const std::string&>() == c) return i;
      ++i;
    }
  std::string what = "one of";
  const char* sep = " ";
  for (std::string_view c : choices) what += cat(std::exchange(sep, ", "), dump(std::string(c)));
  fail_expected(what);
}

std::vector<int64_t> JsonField::integers(int64_t lo, int64_t hi) const {
  std::vector<int64_t> out;
  out.reserve(array());
  for_each_element([&](const JsonField& e) { out.push_back(e.integer(lo, hi)); });
  return out;
}

const JsonField& JsonField::object() const {
  if (!required().is_object()) fail_expected("an object");
  return *this;
}

const JsonField& JsonField::only_keys(std::initializer_list<std::string_view> keys) const {
  object();
  for (auto it = value_->begin(); it != value_->end(); ++it) {
    if (std::find(keys.begin(), keys.end(), std::string_view(it.key())) != keys.end()) continue;
    std::string known;
    for (std::string_view k : keys) known += (known.empty() ? "" : ", ") + std::string(k);
    throw Error(cat(where(), ": unknown key '", it.key(), "' (the keys are ", known, ")"));
  }
  return *this;
}

size_t JsonField::array(size_t min_size, size_t max_size) const {
  const nlohmann::json& v = required();
  if (!v.is_array() || v.size() < min_size || v.size() > max_size) {
    if (min_size == 0 && max_size == SIZE_MAX) fail_expected("an array");
    if (min_size == max_size) fail_expected(cat("an array of ", min_size, min_size == 1 ? " element" : " elements"));
    if (max_size == SIZE_MAX) fail_expected(cat("an array of at least ", min_size, min_size == 1 ? " element" : " elements"));
    fail_expected(cat("an array of ", min_size, " to ", max_size, " elements"));
  }
  return v.size();
}

}  // namespace origami
