// `fastattn list`: every registered attention type and decorator with its
// description and parameter specs (type, default, range or choices, help),
// rendered from the registry's describe() JSON; --json prints that JSON.
#include <nlohmann/json.hpp>

#include <iostream>

#include "cli/command.h"
#include "fastattn/registry.h"

namespace fastattn::cli {
namespace {

// Bounds as the registry prints them: 1 rather than 1.0.
std::string format_bound(double x) {
  if (x == static_cast<double>(static_cast<int64_t>(x))) {
    return std::to_string(static_cast<int64_t>(x));
  }
  return nlohmann::json(x).dump();
}

// "[0, 1)", ">= 1", "a|b|c", "any" from one parameter of describe().
std::string range_text(const nlohmann::json& p) {
  if (p.contains("choices")) {
    std::string out;
    for (const auto& c : p["choices"]) out += (out.empty() ? "" : "|") + c.get<std::string>();
    return out;
  }
  const std::string type = p.value("type", "");
  if (type != "int" && type != "float") return "";
  const bool has_min = p.contains("min"), has_max = p.contains("max");
  const bool min_x = p.value("min_exclusive", false), max_x = p.value("max_exclusive", false);
  if (has_min && has_max) {
    return std::string(min_x ? "(" : "[") + format_bound(p["min"].get<double>()) + ", " +
           format_bound(p["max"].get<double>()) + (max_x ? ")" : "]");
  }
  if (has_min) return (min_x ? "> " : ">= ") + format_bound(p["min"].get<double>());
  if (has_max) return (max_x ? "< " : "<= ") + format_bound(p["max"].get<double>());
  return "any";
}

std::string default_text(const nlohmann::json& p) {
  if (!p.contains("default") || p["default"].is_null()) return "(none)";
  const auto& d = p["default"];
  return d.is_string() ? d.get<std::string>() : d.dump();
}

// "causal and bidirectional; masks: any; incremental rows; step form" from
// the capabilities of describe().
std::string capabilities_text(const nlohmann::json& c) {
  const bool causal = c.value("causal", false), bidirectional = c.value("bidirectional", false);
  std::string out = causal && bidirectional ? "causal and bidirectional"
                    : causal                ? "causal only"
                                            : "bidirectional only";
  const auto twin = c.value(causal ? "bidirectional_form" : "causal_form", std::string());
  if (!twin.empty())
    out += " (" + std::string(causal ? "bidirectional" : "causal") + ": " + twin + ")";
  out += "; attn_mask: " + c.value("attn_mask", std::string("none"));
  const auto rows = c.value("incremental", std::string("no"));
  if (rows != "no")
    out += std::string("; L < S rows") + (rows == "stride" ? " (explicit stride)" : "");
  if (c.value("recurrent", false)) out += "; step form";
  if (c.value("learned", false)) out += "; learned parameters";
  if (c.value("oracle", false)) out += "; an exact oracle, not a speed-up";
  if (c.value("selects", false)) out += "; selects (in float16/bfloat16 it may pick otherwise)";
  if (c.value("channelwise", false)) out += "; channel by channel (values as wide as the keys)";
  return out;
}

// One type or decorator: its name, description, capabilities and a table of
// parameters.
void print_entry(const nlohmann::json& t) {
  std::cout << "\n" << t.value("name", "?") << ": " << t.value("description", "") << "\n";
  if (t.contains("capabilities"))
    std::cout << "  can: " << capabilities_text(t["capabilities"]) << "\n";
  const auto params = t.value("params", nlohmann::json::array());
  if (params.empty()) {
    std::cout << "  (no parameters)\n";
    return;
  }
  std::vector<std::vector<std::string>> rows;
  for (const auto& p : params) {
    rows.push_back({p.value("name", "?"), p.value("type", "?"), default_text(p), range_text(p),
                    p.value("help", "")});
  }
  const std::string table =
      format_table({"parameter", "type", "default", "range/choices", "help"}, rows);
  std::string indented = "  ";
  for (size_t i = 0; i < table.size(); ++i) {
    indented += table[i];
    if (table[i] == '\n' && i + 1 < table.size()) indented += "  ";
  }
  std::cout << indented;
}

class ListCommand : public Command {
 public:
  ListCommand()
      : Command("list", "list every attention type with its parameters, defaults and ranges",
                "Prints each registered attention type, its description and a table of its\n"
                "parameters. Parameters are what `bench --attention type:param=value` and the\n"
                "Python fastattn.attention(type, ..., param=value) accept.\n"
                "The decorator conditional-full:<type> wraps any type: full attention while\n"
                "max(L, S) <= length_limit, <type> beyond it.\n\n"
                "examples:\n"
                "  fastattn list\n"
                "  fastattn list --json > types.json\n") {}
  std::vector<FlagSpec> flags() const override {
    return {FlagSpec::boolean("json", "print the registry's JSON description instead")};
  }

  int run(const Args& args) override {
    // One source for both outputs: the registry's own description.
    const nlohmann::json d = AttentionRegistry::global().describe();
    if (args.get_bool("json")) {
      std::cout << d.dump(2) << "\n";
      return 0;
    }
    const auto types = d.value("types", nlohmann::json::array());
    const auto decorators = d.value("decorators", nlohmann::json::array());
    std::cout << types.size() << " attention types";
    if (!decorators.empty()) std::cout << " and " << decorators.size() << " decorator(s)";
    std::cout << "; `(none)` means optional without a default\n";
    for (const auto& t : types) print_entry(t);
    for (const auto& t : decorators) print_entry(t);
    return 0;
  }
};

FASTATTN_REGISTER_COMMAND(ListCommand);

}  // namespace
}  // namespace fastattn::cli
