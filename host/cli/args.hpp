// A tiny argument parser shared by the subcommands: positionals plus "--name value" options and
// "--flag" switches, with one-line errors for anything unknown or missing.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "command.hpp"

namespace deltasync::cli {

class ParsedArgs {
 public:
  // `options` take a value ("-o", "--model-version"); `switches` do not ("--cpu").
  ParsedArgs(const Args& args, std::set<std::string> options, std::set<std::string> switches);

  const std::vector<std::string>& positional() const { return positional_; }
  // Throws Error("expected N arguments: USAGE") unless exactly n positionals were given.
  void expect_positional(size_t n, const char* usage) const;
  std::optional<std::string> get(const std::string& name) const;
  std::string require(const std::string& name) const;
  // Numbers by core/parse_number.hpp's rules; Error("option --version '-1': not a decimal integer").
  std::optional<uint64_t> get_u64(const std::string& name) const;
  std::optional<double> get_real(const std::string& name) const;
  bool has(const std::string& name) const { return switches_set_.count(name) > 0; }

 private:
  std::vector<std::string> positional_;
  std::map<std::string, std::string> values_;
  std::set<std::string> switches_set_;
};

}  // namespace deltasync::cli
