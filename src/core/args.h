// Command-line options for the `origami` subcommands: declared once with their help text,
// parsed strictly (unknown flag, missing value, malformed number, or an option given twice with two
// values is an Error naming it).
// A run-config JSON file may supply the same keys (without the leading "--"); flags win. A value
// from a file that is not of its option's type is an Error naming the file and the field
// (core/json_fields.h).
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace origami {

class JsonField;

// The name of `names` a user most likely meant by `got` (a typo: at most one edit in four characters,
// and at most 2; or the one name that starts with `got`), or "" when none stands out.
std::string closest_name(const std::string& got, const std::vector<std::string>& names);

class Args {
 public:
  Args(std::string command, std::string summary);

  // An option taking a value. An empty default means "unset" unless given.
  Args& option(const std::string& name, const std::string& metavar, const std::string& help,
               const std::string& default_value = "");
  // The option declared last takes an empty value as a value (generate's --prompt ""). Any other
  // option given an empty value ("--resume=", "--resume \"$UNSET\"", a file's "resume": "") is an
  // Error: it would otherwise read as not given.
  Args& allow_empty();
  // A boolean switch.
  Args& flag(const std::string& name, const std::string& help);

  // Parses argv (argv[0] is the subcommand's name). Returns false when --help was asked for
  // (the help text is then already printed).
  bool parse(int argc, char** argv);
  // Fills options not given on the command line from a JSON object (a run-config file, a plan's
  // layout): a switch from true or false, an option from a string or a number. An option an earlier
  // object set keeps its value, and another value for it is an Error naming both.
  void fill_from_json(const JsonField& obj);

  bool has(const std::string& name) const;  // given, from a file, or with a non-empty default
  bool given(const std::string& name) const;  // on the command line or from a file (not a default)
  std::string str(const std::string& name) const;
  int64_t integer(const std::string& name) const;  // Error outside 64-bit integers
  uint64_t unsigned_integer(const std::string& name) const;  // Error outside [0, 2^64): seeds
  int small_integer(const std::string& name) const;  // Error outside [-2^31, 2^31): degrees, counts of threads
  double number(const std::string& name) const;
  std::vector<int64_t> integers(const std::string& name) const;  // "5,6,6,5"
  bool on(const std::string& name) const;
  // Where the value of `name` came from, for messages: "--name", or "FILE: field 'name'" from a file.
  std::string source(const std::string& name) const;
  std::string help() const;

 private:
  struct Opt {
    std::string metavar, help, value;
    bool is_flag = false, set = false, empty_ok = false;
    std::string origin, given;  // a value from a file: "FILE: field 'NAME'" and the value as the file gives it
  };
  const Opt& get(const std::string& name) const;
  // The value of `name` is not `what` ("an integer", ...): an Error naming the flag or the file's field.
  [[noreturn]] void bad_value(const std::string& name, const char* what) const;
  std::string command_, summary_;
  std::vector<std::string> order_;
  std::map<std::string, Opt> opts_;
};

}  // namespace origami
