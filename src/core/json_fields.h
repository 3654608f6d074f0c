// Typed reading of JSON inputs: every value a reader takes from a file (model config, run config,
// plan and cluster files, checkpoint metadata and trainer state, tokenizer files, safetensors
// headers) is read as a JsonField of a given type and range, or the read throws origami::Error
// with one message of one form:
//
//   FILE: field 'NAME': expected WHAT, got VALUE    a value of the wrong type or out of range
//   FILE: field 'NAME': missing                     a required field the object does not have
//
// NAME is the field's path from the document's root: object keys joined by '.', array elements by
// their index in brackets (tensors.wte.shape[1]); a key other than a plain word (letters, digits,
// '_', '-') is written as a JSON string in brackets (model.vocab["Ġthe"], tensors["h.0.ln_1.bias"]).
// VALUE is the value as the file gives it, in JSON (a string in quotes), shortened past 60
// characters. A value of the document root itself has no field part: "FILE: expected WHAT, got VALUE".
// A null counts as absent where a field is optional (Hugging Face files write null for "not set");
// a required field that is null has the wrong type ("got null").
//
// Every read checks its value before nlohmann's accessors see it, so none of the library's
// type_error / out_of_range exceptions can reach the user; parse_json turns its parse errors into
// an Error naming the file.
#pragma once
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace origami {

// Parses JSON text; an Error names the file: "FILE: not valid JSON (the parser's message)". Text nested
// deeper than kMaxJsonDepth is refused before parsing ("FILE: nests arrays and objects N levels deep"):
// the library parses any depth, but copying, printing or destroying the value recurses, and 100000
// levels overflowed the stack.
nlohmann::json parse_json(std::string_view text, const std::string& file);
constexpr int kMaxJsonDepth = 1000;
// The deepest nesting of arrays and objects in JSON text (brackets inside strings do not count).
int json_depth(std::string_view text);
// Reads and parses a file (an unreadable file is an Error naming it, as read_file_bytes says).
nlohmann::json parse_json_file(const std::string& path);
// The parse both readers share: nlohmann keeps the last value of a key an object gives twice, silently;
// here that is an Error, "LABEL: gives 'KEY' twice in one object (at PATH): the last would win and the
// first be ignored; give it once". Parse errors are nlohmann's exceptions, for the caller to word.
nlohmann::json parse_json_keys_once(std::string_view text, const std::string& label);

// The bounds of a number field: [lo, hi], or (lo, hi] when lo_open. A number read is always finite.
struct NumberRange {
  static constexpr double kMax = std::numeric_limits<double>::max();
  double lo = -kMax, hi = kMax;
  bool lo_open = false;

  static NumberRange any() { return {}; }
  static NumberRange positive() { return {0, kMax, true}; }
  static NumberRange at_least(double lo) { return {lo, kMax, false}; }
  static NumberRange between(double lo, double hi) { return {lo, hi, false}; }
  bool holds(double x) const;
  std::string describe() const;  // "a number", "a positive number", "a number in [0, 1]", ...
};

// "an integer in [lo, hi]", "a positive integer" (lo 1, no upper bound), ...
std::string describe_integer_range(int64_t lo, int64_t hi);

class JsonField {
 public:
  static constexpr int64_t kNoLimit = std::numeric_limits<int64_t>::max();

  // The document `root` of `file` (the name messages give it). The field refers to `root`, which
  // must outlive it and every field read from it.
  JsonField(const nlohmann::json& root, std::string file);

  // A member of this object, or an element of this array: absent when this field is absent (or
  // null) or has no such member or element. This field, when present, must be an object (an array).
  JsonField operator[](std::string_view key) const;
  JsonField operator[](size_t index) const;

  bool present() const { return value_ != nullptr && !value_->is_null(); }
  // The value as parsed, for a reader that decides by its kind (present() must hold).
  const nlohmann::json& json() const { return *value_; }
  const std::string& file() const { return *file_; }
  std::string name() const;  // its path ("" for the root)

  // Required reads: the field must be present, of the type, in the range.
  int64_t integer(int64_t lo, int64_t hi) const;
  double number(NumberRange range = {}) const;
  bool boolean() const;
  const std::string& string() const;
  // A string among `choices`: its index.
  size_t one_of(std::initializer_list<std::string_view> choices) const;
  // An array of integers, each in [lo, hi].
  std::vector<int64_t> integers(int64_t lo, int64_t hi) const;
  // An object (returns this field) / an array of min_size..max_size elements (returns its size).
  const JsonField& object() const;
  // An object whose every key is one of `keys` (returns this field): a misspelt key is an Error
  // naming it, not a setting silently left at its default.
  const JsonField& only_keys(std::initializer_list<std::string_view> keys) const;
  size_t array(size_t min_size = 0, size_t max_size = SIZE_MAX) const;

  // Optional reads: `dflt` when the field is absent or null, else as the required reads.
  int64_t integer_or(int64_t dflt, int64_t lo, int64_t hi) const { return present() ? integer(lo, hi) : dflt; }
  double number_or(double dflt, NumberRange range = {}) const { return present() ? number(range) : dflt; }
  bool boolean_or(bool dflt) const { return present() ? boolean() : dflt; }
  std::string string_or(const std::string& dflt) const { return present() ? string() : dflt; }

  // Calls f(key, field) for each member of this object / f(field) for each element of this array,
  // in the file's order (the field must be an object / an array).
  template <typename F>
  void for_each_member(F&& f) const {
    object();
    const std::string path = name();
    for (auto it = value_->begin(); it != value_->end(); ++it) f(it.key(), JsonField(&it.value(), file_, path, it.key()));
  }
  template <typename F>
  void for_each_element(F&& f) const {
    array();
    const std::string path = name();
    for (size_t i = 0; i < value_->size(); ++i) f(JsonField(&(*value_)[i], file_, path, i));
  }

  // The uniform failures, for a reader's own rules on a field: "FILE: field 'NAME': expected WHAT,
  // got VALUE" and "FILE: field 'NAME': missing". where() is their "FILE: field 'NAME'" part.
  [[noreturn]] void fail_expected(std::string_view what) const;
  [[noreturn]] void fail_missing() const;
  std::string where() const;
  std::string got() const;  // the value as the file gives it, shortened (present or null only)

 private:
  // A member `key` / element `index` of the field named `parent`. The name is put together only
  // when a message needs it: a reader walks every member of a vocabulary of 10^5 tokens.
  JsonField(const nlohmann::json* value, std::shared_ptr<const std::string> file, std::string parent, std::string key)
      : value_(value), file_(std::move(file)), parent_(std::move(parent)), key_(std::move(key)), kind_(kMember) {}
  JsonField(const nlohmann::json* value, std::shared_ptr<const std::string> file, std::string parent, size_t index)
      : value_(value), file_(std::move(file)), parent_(std::move(parent)), index_(index), kind_(kElement) {}
  const nlohmann::json& required() const;  // the value; fail_missing() when absent

  const nlohmann::json* value_;  // null when absent
  std::shared_ptr<const std::string> file_;
  std::string parent_;  // the name of the object or array that holds it
  std::string key_;     // a member's key
  size_t index_ = 0;    // an element's index
  enum Kind { kRoot, kMember, kElement } kind_ = kRoot;
};

}  // namespace origami
