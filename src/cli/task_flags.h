// Task types' settings as command-line flags, shared by `fastattn train` (a
// type's TaskType::settings) and `fastattn generate --checkpoint` (its
// TaskGenerator::flags): one flag per setting name with its help, the
// refusal of a flag that belongs to other types, and the given values as
// JSON typed by their kind.
#pragma once

#include <nlohmann/json.hpp>

#include <functional>
#include <string>
#include <vector>

#include "cli/command.h"
#include "fastattn/experiments/train.h"

namespace fastattn::cli {

// Which settings of a task type a command offers.
using SettingsOf = std::function<const std::vector<train::TaskSetting>&(const train::TaskType&)>;

const train::TaskSetting* find_setting(const std::vector<train::TaskSetting>& settings,
                                       const std::string& flag);

// "copy or charlm": the names of the task types for which `has` holds.
std::string task_types_where(const std::function<bool(const train::TaskType&)>& has);

// One flag per setting name over every task type, in order of first
// appearance: "copy, transduction: number of symbols" with its default where
// the types agree, else each type's ("copy: symbols per half (32); charlm:
// window (256)").
std::vector<FlagSpec> setting_flag_specs(const SettingsOf& of);

// Throws UsageError for a flag of setting_flag_specs(of) given in args that
// `type` does not have: "--F applies to --task A or B" + `suffix`.
void refuse_other_types_flags(const train::TaskType& type, const SettingsOf& of, const Args& args,
                              const std::string& suffix = "");

// {key: value} of the settings given in args, typed by their kind.
nlohmann::json given_settings(const std::vector<train::TaskSetting>& settings, const Args& args);

}  // namespace fastattn::cli
