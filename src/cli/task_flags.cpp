// Task types' settings as command-line flags (task_flags.h).
#include "cli/task_flags.h"

#include <algorithm>
#include <utility>

namespace fastattn::cli {

const train::TaskSetting* find_setting(const std::vector<train::TaskSetting>& settings,
                                       const std::string& flag) {
  for (const auto& s : settings)
    if (s.flag == flag) return &s;
  return nullptr;
}

std::string task_types_where(const std::function<bool(const train::TaskType&)>& has) {
  std::string out;
  for (const auto& t : train::task_types())
    if (has(t)) out += (out.empty() ? "" : " or ") + t.name;
  return out;
}

std::vector<FlagSpec> setting_flag_specs(const SettingsOf& of) {
  std::vector<std::string> names;
  for (const auto& t : train::task_types())
    for (const auto& s : of(t))
      if (std::find(names.begin(), names.end(), s.flag) == names.end()) names.push_back(s.flag);
  std::vector<FlagSpec> out;
  for (const auto& name : names) {
    std::vector<std::pair<const train::TaskType*, const train::TaskSetting*>> uses;
    for (const auto& t : train::task_types())
      if (const auto* s = find_setting(of(t), name)) uses.emplace_back(&t, s);
    const auto* first = uses.front().second;
    bool same = true;  // one help and default for all: "copy, transduction: ..."
    for (const auto& use : uses)
      same = same && use.second->help == first->help &&
             use.second->default_text == first->default_text;
    std::string help;
    for (const auto& [t, s] : uses) {
      if (same) {
        help += (help.empty() ? "" : ", ") + t->name;
        continue;
      }
      help += (help.empty() ? "" : "; ") + t->name + ": " + s->help;
      if (!s->default_text.empty()) help += " (" + s->default_text + ")";
    }
    if (same) help += ": " + first->help;
    if (first->kind == train::TaskSetting::Kind::Boolean) {
      out.push_back(FlagSpec::boolean(name, help));
    } else {
      out.push_back(FlagSpec::value(name, first->metavar, help, same ? first->default_text : ""));
    }
  }
  return out;
}

void refuse_other_types_flags(const train::TaskType& type, const SettingsOf& of, const Args& args,
                              const std::string& suffix) {
  for (const auto& f : setting_flag_specs(of)) {
    if (args.has(f.name) && find_setting(of(type), f.name) == nullptr) {
      throw UsageError("--" + f.name + " applies to --task " +
                       task_types_where([&](const train::TaskType& other) {
                         return find_setting(of(other), f.name) != nullptr;
                       }) +
                       suffix);
    }
  }
}

nlohmann::json given_settings(const std::vector<train::TaskSetting>& settings, const Args& args) {
  auto out = nlohmann::json::object();
  for (const auto& s : settings) {
    if (!args.has(s.flag)) continue;
    switch (s.kind) {
      case train::TaskSetting::Kind::Integer:
        out[s.key] = args.get_int(s.flag, 0);
        break;
      case train::TaskSetting::Kind::Number:
        out[s.key] = args.get_double(s.flag, 0);
        break;
      case train::TaskSetting::Kind::Text:
        out[s.key] = args.get(s.flag);
        break;
      case train::TaskSetting::Kind::Boolean:
        out[s.key] = args.get_bool(s.flag);
        break;
    }
  }
  return out;
}

}  // namespace fastattn::cli
