#include "format/model_version.hpp"

#include "core/parse_number.hpp"

namespace deltasync {

std::optional<uint64_t> read_model_version(const st::Metadata& md, const std::string& label) {
  const auto it = md.find(kModelVersionKey);
  if (it == md.end()) return std::nullopt;
  return parse_decimal<uint64_t>(it->second, label + ": metadata " + kModelVersionKey);
}

}  // namespace deltasync
