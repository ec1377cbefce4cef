// The `fastattn` program: the command layer (flag parser, command table, help)
// and main(). Commands live one per file in src/cli/cmd_*.cpp and register
// themselves with FASTATTN_REGISTER_COMMAND.
//
//   fastattn --help | fastattn --version | fastattn <command> --help
//   fastattn [--threads N] [--cpu-capability LEVEL] <command> [flags]
//
// Exit codes: 0 success, 1 runtime error, 2 bad command line.
#include <dlfcn.h>
#include <sched.h>
#include <unistd.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <thread>

#include <torch/version.h>

#include "cli/command.h"
#include "fastattn/ops.h"
#include "kernels/common/cpu_isa.h"

namespace fastattn::cli {

// ---- flags -----------------------------------------------------------------

FlagSpec FlagSpec::value(std::string name, std::string value_name, std::string help,
                         std::string default_text) {
  FlagSpec f;
  f.name = std::move(name);
  f.value_name = std::move(value_name);
  f.help = std::move(help);
  f.default_text = std::move(default_text);
  return f;
}

FlagSpec FlagSpec::boolean(std::string name, std::string help) {
  FlagSpec f;
  f.name = std::move(name);
  f.is_bool = true;
  f.help = std::move(help);
  return f;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == sep) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  out.push_back(cur);
  return out;
}

int64_t parse_int(const std::string& s, const std::string& what) {
  errno = 0;
  char* end = nullptr;
  const long long x = std::strtoll(s.c_str(), &end, 10);
  if (s.empty() || end != s.c_str() + s.size() || errno == ERANGE) {
    throw UsageError(what + " must be an integer, got '" + s + "'");
  }
  return static_cast<int64_t>(x);
}

double parse_double(const std::string& s, const std::string& what) {
  errno = 0;
  char* end = nullptr;
  const double x = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || errno == ERANGE) {
    throw UsageError(what + " must be a number, got '" + s + "'");
  }
  return x;
}

bool parse_bool(const std::string& s, const std::string& what) {
  if (s == "true" || s == "1" || s == "yes" || s == "on") return true;
  if (s == "false" || s == "0" || s == "no" || s == "off") return false;
  throw UsageError(what + " must be true or false, got '" + s + "'");
}

std::string Args::get(const std::string& name, const std::string& def) const {
  auto it = values_.find(name);
  return it == values_.end() ? def : it->second;
}

bool Args::get_bool(const std::string& name) const {
  auto it = values_.find(name);
  return it != values_.end() && parse_bool(it->second, "--" + name);
}

int64_t Args::get_int(const std::string& name, int64_t def) const {
  auto it = values_.find(name);
  return it == values_.end() ? def : parse_int(it->second, "--" + name);
}

double Args::get_double(const std::string& name, double def) const {
  auto it = values_.find(name);
  return it == values_.end() ? def : parse_double(it->second, "--" + name);
}

std::vector<std::string> Args::get_list(const std::string& name,
                                        const std::vector<std::string>& def) const {
  auto it = values_.find(name);
  if (it == values_.end()) return def;
  auto items = split(it->second, ',');
  for (const auto& item : items) {
    if (item.empty()) {
      throw UsageError("--" + name + " has an empty item in '" + it->second +
                       "' (a comma-separated list)");
    }
  }
  return items;
}

std::vector<int64_t> Args::get_int_list(const std::string& name,
                                        const std::vector<int64_t>& def) const {
  if (!has(name)) return def;
  std::vector<int64_t> out;
  for (const auto& item : get_list(name, {})) out.push_back(parse_int(item, "--" + name));
  return out;
}

namespace {

std::string flag_names(const std::vector<FlagSpec>& specs) {
  std::string out;
  for (const auto& f : specs) out += (out.empty() ? "--" : ", --") + f.name;
  return out;
}

}  // namespace

Args parse_flags(const std::vector<std::string>& tokens, const std::vector<FlagSpec>& specs,
                 bool allow_positional, const std::string& context) {
  Args args;
  bool flags_done = false;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const std::string& tok = tokens[i];
    if (flags_done || tok.size() < 2 || tok.compare(0, 2, "--") != 0) {
      if (tok == "-h" && !flags_done) {
        args.set("help", "true");
        continue;
      }
      if (!allow_positional) {
        throw UsageError(context + ": unexpected argument '" + tok +
                         "' (flags start with --; valid flags: " + flag_names(specs) + ")");
      }
      args.add_positional(tok);
      continue;
    }
    if (tok == "--") {
      flags_done = true;
      continue;
    }
    const auto eq = tok.find('=');
    const std::string name = tok.substr(2, eq == std::string::npos ? std::string::npos : eq - 2);
    auto spec =
        std::find_if(specs.begin(), specs.end(), [&](const FlagSpec& f) { return f.name == name; });
    if (spec == specs.end()) {
      throw UsageError(context + ": unknown flag '--" + name +
                       "'; valid flags: " + flag_names(specs));
    }
    if (args.has(name)) throw UsageError(context + ": flag --" + name + " given twice");
    if (spec->is_bool) {
      const std::string value = eq == std::string::npos ? "true" : tok.substr(eq + 1);
      parse_bool(value, "--" + name);  // reject --causal=maybe now
      args.set(name, value);
    } else if (eq != std::string::npos) {
      args.set(name, tok.substr(eq + 1));
    } else {
      if (i + 1 >= tokens.size()) {
        throw UsageError(context + ": flag --" + name + " needs a value (" + spec->value_name +
                         ")");
      }
      args.set(name, tokens[++i]);
    }
  }
  return args;
}

void write_stderr(const std::string& text) {
  std::cerr.flush();
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(STDERR_FILENO, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // nowhere left to report to
    done += static_cast<size_t>(n);
  }
}

std::string format_table(const std::vector<std::string>& header,
                         const std::vector<std::vector<std::string>>& rows,
                         const std::vector<bool>& right) {
  std::vector<size_t> width(header.size(), 0);
  auto measure = [&](const std::vector<std::string>& row) {
    for (size_t c = 0; c < row.size() && c < width.size(); ++c) {
      width[c] = std::max(width[c], row[c].size());
    }
  };
  measure(header);
  for (const auto& r : rows) measure(r);
  std::ostringstream os;
  auto emit = [&](const std::vector<std::string>& row) {
    std::string line;
    for (size_t c = 0; c < width.size(); ++c) {
      const std::string cell = c < row.size() ? row[c] : "";
      const std::string pad(width[c] - cell.size(), ' ');
      const bool r = c < right.size() && right[c];
      if (c > 0) line += "  ";
      line += r ? pad + cell : cell + (c + 1 < width.size() ? pad : "");
    }
    os << line << "\n";
  };
  emit(header);
  std::vector<std::string> rule;
  for (size_t w : width) rule.push_back(std::string(w, '-'));
  emit(rule);
  for (const auto& r : rows) emit(r);
  return os.str();
}

// ---- command table -----------------------------------------------------------

namespace {
std::vector<CommandFactory>& factories() {
  static std::vector<CommandFactory> f;
  return f;
}
}  // namespace

bool register_command(CommandFactory factory) {
  factories().push_back(factory);
  return true;
}

std::vector<std::unique_ptr<Command>> all_commands() {
  std::vector<std::unique_ptr<Command>> out;
  for (auto f : factories()) out.push_back(f());
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a->name() < b->name(); });
  return out;
}

namespace {

// The cores this process may run on (respects taskset/cpusets).
int64_t machine_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? n : 1;
}

}  // namespace

std::string best_cpu_capability() { return kernels::cpu_isa_name(kernels::best_cpu_isa()); }

namespace {

// OpenBLAS's name of the kernels it uses, when LibTorch's BLAS is OpenBLAS
// (Debian's LibTorch); empty otherwise (pip's torch: MKL).
std::string openblas_core() {
  using Corename = const char* (*)();
  const auto corename = reinterpret_cast<Corename>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  const char* name = corename ? corename() : nullptr;
  return name ? name : "";
}

constexpr const char* kOpenblasChoseEnv = "FASTATTN_OPENBLAS_CHOSE";

// When OpenBLAS took a core without AVX2 kernels on a CPU that has them
// (kernels::openblas_core_override: an OpenBLAS older than the CPU), sets
// OPENBLAS_CORETYPE and starts this program again: OpenBLAS reads the
// variable once, as it loads, before main. A set OPENBLAS_CORETYPE is left
// alone (also on the second start). If the restart fails, runs on as is.
void restart_with_openblas_core(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE")) return;
  const std::string chosen = openblas_core();
  if (chosen.empty()) return;
  using kernels::CpuIsa;
  const CpuIsa cpu = kernels::cpu_isa_supported(CpuIsa::kAvx512) ? CpuIsa::kAvx512
                     : kernels::cpu_isa_supported(CpuIsa::kAvx2) ? CpuIsa::kAvx2
                                                                 : CpuIsa::kDefault;
  const char* core = kernels::openblas_core_override(chosen, cpu);
  if (!core) return;
  setenv("OPENBLAS_CORETYPE", core, 1);
  setenv(kOpenblasChoseEnv, chosen.c_str(), 1);
  execv("/proc/self/exe", argv);
  unsetenv("OPENBLAS_CORETYPE");
  unsetenv(kOpenblasChoseEnv);
}

}  // namespace

void print_version() {
  std::string supported;
  for (const auto& s : supported_cpu_capabilities())
    supported += (supported.empty() ? "" : ", ") + s;
  const std::string active = cpu_capability();  // may throw: print nothing then
  std::cout << "fastattn " << FASTATTN_VERSION_STRING << " (LibTorch " << TORCH_VERSION
            << ")\nCPU kernels: " << active << " (this CPU and build: " << supported << ")\n";
  if (const std::string core = openblas_core(); !core.empty()) {
    std::cout << "BLAS: OpenBLAS, " << core << " kernels";
    if (const char* chose = std::getenv(kOpenblasChoseEnv))
      std::cout << " (OPENBLAS_CORETYPE set by fastattn: OpenBLAS had chosen " << chose
                << ", without AVX2, for this CPU)";
    std::cout << "\n";
  }
}

std::vector<FlagSpec> global_flags() {
  return {FlagSpec::value("threads", "N",
                          "intra-op threads for LibTorch and our kernels (at::set_num_threads)",
                          std::to_string(machine_cores()) + ", this machine's cores"),
          FlagSpec::value("cpu-capability", "LEVEL",
                          "instruction set of the CPU kernels: default, avx2, avx512, avx512_bf16 "
                          "or amx (as FASTATTN_CPU_CAPABILITY)",
                          "the best for this CPU, " + best_cpu_capability()),
          FlagSpec::boolean("version", "print the version and the CPU kernels' instruction set"),
          FlagSpec::boolean("help", "show help (also -h)")};
}

namespace {

std::string flags_help(const std::vector<FlagSpec>& specs) {
  std::vector<std::string> left;
  size_t width = 0;
  for (const auto& f : specs) {
    left.push_back("  --" + f.name + (f.is_bool ? "" : " " + f.value_name));
    width = std::max(width, left.back().size());
  }
  std::ostringstream os;
  for (size_t i = 0; i < specs.size(); ++i) {
    os << left[i] << std::string(width - left[i].size() + 3, ' ') << specs[i].help;
    if (!specs[i].default_text.empty()) os << " (default: " << specs[i].default_text << ")";
    os << "\n";
  }
  return os.str();
}

std::string command_names(const std::vector<std::unique_ptr<Command>>& cmds) {
  std::string out;
  for (const auto& c : cmds) out += (out.empty() ? "" : ", ") + c->name();
  return out;
}

void print_main_help(const std::vector<std::unique_ptr<Command>>& cmds) {
  std::cout << "fastattn: efficient transformer attention for LibTorch\n\n"
            << "usage: fastattn [--threads N] [--cpu-capability LEVEL] <command> [flags]\n"
            << "       fastattn <command> --help\n\ncommands:\n";
  size_t width = 0;
  for (const auto& c : cmds) width = std::max(width, c->name().size());
  for (const auto& c : cmds) {
    std::cout << "  " << c->name() << std::string(width - c->name().size() + 3, ' ') << c->help()
              << "\n";
  }
  std::cout << "\nglobal flags (before or after the command):\n"
            << flags_help(global_flags())
            << "\nFlags: --name value or --name=value; booleans: --name or --name=true|false.\n"
            << "Exit codes: 0 success, 1 runtime error, 2 bad command line.\n";
}

void print_command_help(const Command& c) {
  std::cout << "usage: fastattn " << c.name() << " [flags]\n\n" << c.help() << "\n\n" << c.usage();
  if (!c.usage().empty() && c.usage().back() != '\n') std::cout << "\n";
  const auto flags = c.flags();
  if (!flags.empty()) std::cout << "\nflags:\n" << flags_help(flags);
  std::cout << "\nglobal flags:\n" << flags_help(global_flags());
}

// --cpu-capability: a level this CPU does not run is a command-line error.
void apply_cpu_capability(const std::string& level) {
  try {
    kernels::set_cpu_isa(kernels::parse_cpu_isa(level, "--cpu-capability"));
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
}

int run_main(const std::vector<std::string>& argv) {
  auto cmds = all_commands();
  // Global flags before the command name.
  size_t i = 0;
  std::vector<std::string> before;
  while (i < argv.size() && argv[i].size() > 0 && argv[i][0] == '-') {
    before.push_back(argv[i]);
    // A value flag given as "--threads N" takes the next token along.
    if ((argv[i] == "--threads" || argv[i] == "--cpu-capability") && i + 1 < argv.size())
      before.push_back(argv[++i]);
    ++i;
  }
  Args global = parse_flags(before, global_flags(), false, "fastattn");
  if (global.has("cpu-capability")) apply_cpu_capability(global.get("cpu-capability"));
  if (global.get_bool("version")) {
    print_version();
    return 0;
  }
  if (i == argv.size()) {
    print_main_help(cmds);
    if (global.get_bool("help")) return 0;
    std::cerr << "\nfastattn: error: no command given; valid commands: " << command_names(cmds)
              << "\n";
    return 2;
  }
  const std::string name = argv[i];
  if (name == "help") {  // `fastattn help [command]` as a courtesy
    if (i + 1 < argv.size()) {
      for (const auto& c : cmds) {
        if (c->name() == argv[i + 1]) {
          print_command_help(*c);
          return 0;
        }
      }
      throw UsageError("unknown command '" + argv[i + 1] +
                       "'; valid commands: " + command_names(cmds));
    }
    print_main_help(cmds);
    return 0;
  }
  Command* cmd = nullptr;
  for (const auto& c : cmds) {
    if (c->name() == name) cmd = c.get();
  }
  if (cmd == nullptr) {
    throw UsageError("unknown command '" + name + "'; valid commands: " + command_names(cmds));
  }
  auto specs = cmd->flags();
  const auto g = global_flags();
  specs.insert(specs.end(), g.begin(), g.end());
  const std::vector<std::string> rest(argv.begin() + static_cast<std::ptrdiff_t>(i) + 1,
                                      argv.end());
  Args args = parse_flags(rest, specs, cmd->allow_positional(), "fastattn " + name);
  if (args.get_bool("help") || global.get_bool("help")) {
    print_command_help(*cmd);
    return 0;
  }
  if (args.has("cpu-capability")) {
    if (global.has("cpu-capability"))
      throw UsageError("--cpu-capability given twice (before and after the command)");
    apply_cpu_capability(args.get("cpu-capability"));
  }
  if (args.get_bool("version")) {
    print_version();
    return 0;
  }
  if (global.has("threads") && args.has("threads")) {
    throw UsageError("--threads given twice (before and after the command)");
  }
  const std::string threads_text =
      args.has("threads") ? args.get("threads") : global.get("threads");
  const int64_t threads =
      threads_text.empty() ? machine_cores() : parse_int(threads_text, "--threads");
  if (threads < 1) throw UsageError("--threads must be >= 1, got " + threads_text);
  // Debian's LibTorch starts with one thread; this only sets the count (no
  // thread starts before the first parallel region).
  at::set_num_threads(static_cast<int>(threads));
  args.set("threads", std::to_string(threads));
  return cmd->run(args);
}

}  // namespace
}  // namespace fastattn::cli

int main(int argc, char** argv) {
  fastattn::cli::restart_with_openblas_core(argv);
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    return fastattn::cli::run_main(args);
  } catch (const fastattn::cli::UsageError& e) {
    fastattn::cli::write_stderr(std::string("fastattn: error: ") + e.what() +
                                "\n(see fastattn --help)\n");
    return 2;
  } catch (const c10::Error& e) {
    // c10 messages carry a C++ backtrace after the first line break only in
    // what(); what_without_backtrace() is the user-facing part.
    fastattn::cli::write_stderr(std::string("fastattn: error: ") + e.what_without_backtrace() +
                                "\n");
    return 1;
  } catch (const std::exception& e) {
    fastattn::cli::write_stderr(std::string("fastattn: error: ") + e.what() + "\n");
    return 1;
  }
}
