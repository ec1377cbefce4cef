// The command layer of the `fastattn` program: a Command interface, a table
// of commands filled by static registration, and a flag parser of our own.
//
// Adding a command is one file in src/cli/:
//
//   class TrainCommand : public Command {
//    public:
//     TrainCommand() : Command("train", "train a model on a task", "Longer text...") {}
//     std::vector<FlagSpec> flags() const override {
//       return {FlagSpec::value("steps", "N", "optimiser steps", "1000")};
//     }
//     int run(const Args& args) override { ... args.get_int("steps") ... }
//   };
//   FASTATTN_REGISTER_COMMAND(TrainCommand);
//
// Flags: `--name value`, `--name=value`; boolean flags are `--name` (true) or
// `--name=true|false`. `--` ends the flags. A bad command line throws
// UsageError, which main() turns into a message and exit code 2.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace fastattn::cli {

// A mistake on the command line (exit code 2).
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct FlagSpec {
  std::string name;        // without the leading "--"
  bool is_bool = false;    // boolean flags take no separate value
  std::string value_name;  // shown in help: --length LIST
  std::string help;
  std::string default_text;  // shown in help; "" shows nothing

  static FlagSpec value(std::string name, std::string value_name, std::string help,
                        std::string default_text = "");
  static FlagSpec boolean(std::string name, std::string help);
};

// Parsed flags and positional arguments. The typed getters throw UsageError
// naming the flag when a value does not parse.
class Args {
 public:
  bool has(const std::string& name) const { return values_.count(name) > 0; }
  std::string get(const std::string& name, const std::string& def = "") const;
  bool get_bool(const std::string& name) const;  // false when absent
  int64_t get_int(const std::string& name, int64_t def) const;
  double get_double(const std::string& name, double def) const;
  // Comma-separated list; `def` when absent. Empty items are an error.
  std::vector<std::string> get_list(const std::string& name,
                                    const std::vector<std::string>& def) const;
  std::vector<int64_t> get_int_list(const std::string& name, const std::vector<int64_t>& def) const;
  const std::vector<std::string>& positional() const { return positional_; }

  void set(const std::string& name, std::string value) { values_[name] = std::move(value); }
  void add_positional(std::string arg) { positional_.push_back(std::move(arg)); }

 private:
  std::map<std::string, std::string> values_;
  std::vector<std::string> positional_;
};

// Parses argv-style tokens against `specs`. Unknown flags, missing values,
// repeated flags and (unless allow_positional) positional arguments throw
// UsageError listing what is valid.
Args parse_flags(const std::vector<std::string>& tokens, const std::vector<FlagSpec>& specs,
                 bool allow_positional, const std::string& context);

// Strict number parsing shared by the commands: the whole string must be the
// number. `what` names the value in the error.
int64_t parse_int(const std::string& s, const std::string& what);
double parse_double(const std::string& s, const std::string& what);
bool parse_bool(const std::string& s, const std::string& what);
std::vector<std::string> split(const std::string& s, char sep);

// A subcommand: its texts are data given at construction, its flags and its
// run() code.
class Command {
 public:
  // help: one line, for `fastattn --help`; usage: the longer text of
  // `fastattn <name> --help`.
  Command(std::string name, std::string help, std::string usage)
      : name_(std::move(name)), help_(std::move(help)), usage_(std::move(usage)) {}
  virtual ~Command() = default;
  const std::string& name() const { return name_; }
  const std::string& help() const { return help_; }
  const std::string& usage() const { return usage_; }
  virtual std::vector<FlagSpec> flags() const = 0;
  virtual bool allow_positional() const { return false; }
  // Returns the exit code; may throw UsageError (exit 2) or any other
  // exception (printed, exit 1).
  virtual int run(const Args& args) = 0;

 private:
  std::string name_, help_, usage_;
};

using CommandFactory = std::unique_ptr<Command> (*)();
// The table, in registration order sorted by name.
std::vector<std::unique_ptr<Command>> all_commands();
bool register_command(CommandFactory factory);

// Flags every command accepts (--threads, --help).
std::vector<FlagSpec> global_flags();

// Formats a table: columns padded to their widest cell; `right` marks
// right-aligned columns.
std::string format_table(const std::vector<std::string>& header,
                         const std::vector<std::vector<std::string>>& rows,
                         const std::vector<bool>& right = {});

// Writes `text` to stderr in one write(2) call (repeated only on a partial
// write), so that a line of the --nproc launcher and a worker's error, which
// share the stream, never interleave mid-line (writes up to PIPE_BUF bytes to a
// pipe are atomic; std::cerr issues one write per <<).
void write_stderr(const std::string& text);

}  // namespace fastattn::cli

#define FASTATTN_REGISTER_COMMAND(Class)                                                 \
  static const bool fastattn_cli_registered_##Class = ::fastattn::cli::register_command( \
      []() -> std::unique_ptr<::fastattn::cli::Command> { return std::make_unique<Class>(); })
