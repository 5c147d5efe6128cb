// One exception type for every user-facing failure. The message is a single line that names the
// file or tensor at fault and the reason, so a CLI can print it as is.
#pragma once
#include <stdexcept>
#include <string>

namespace deltasync {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace deltasync
