#include "args.hpp"


#include "core/error.hpp"
#include "core/parse_number.hpp"

namespace deltasync::cli {

ParsedArgs::ParsedArgs(const Args& args, std::set<std::string> options, std::set<std::string> switches) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.size() > 1 && a[0] == '-' && a != "-") {
      std::string name = a, value;
      bool inline_value = false;
      if (auto eq = a.find('='); eq != std::string::npos && a.rfind("--", 0) == 0) {
        name = a.substr(0, eq);
        value = a.substr(eq + 1);
        inline_value = true;
      }
      if (options.count(name)) {
        if (!inline_value) {
          if (i + 1 >= args.size()) throw Error("option " + name + " needs a value");
          value = args[++i];
        }
        values_[name] = value;
      } else if (switches.count(name) && !inline_value) {
        switches_set_.insert(name);
      } else {
        throw Error("unknown option " + name);
      }
    } else {
      positional_.push_back(a);
    }
  }
}

void ParsedArgs::expect_positional(size_t n, const char* usage) const {
  if (positional_.size() != n) throw Error(std::string("expected ") + std::to_string(n) + " arguments: " + usage);
}

std::optional<std::string> ParsedArgs::get(const std::string& name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

std::string ParsedArgs::require(const std::string& name) const {
  auto v = get(name);
  if (!v) throw Error("missing required option " + name);
  return *v;
}

std::optional<uint64_t> ParsedArgs::get_u64(const std::string& name) const {
  auto v = get(name);
  if (!v) return std::nullopt;
  return parse_decimal<uint64_t>(*v, "option " + name, ErrorKind::kInvalidArgument);
}

std::optional<double> ParsedArgs::get_real(const std::string& name) const {
  auto v = get(name);
  if (!v) return std::nullopt;
  return parse_decimal_real(*v, "option " + name, ErrorKind::kInvalidArgument);
}

}  // namespace deltasync::cli
