// The one number rule (core/parse_number.hpp) for Python, so that versions read from vLLM's
// routes and the weight-transfer backend's JSON obey the same rule as every number the C++ side
// reads: decimal digits only, no sign, no spaces, range-checked.
#include <pybind11/stl.h>

#include <optional>
#include <string>

#include "bindings/module.hpp"
#include "core/parse_number.hpp"

namespace py = pybind11;

namespace deltasync::torch_ext {

void bind_numbers(py::module_& m) {
  m.def(
      "parse_decimal",
      [](const std::string& text, const std::string& what) { return parse_decimal<uint64_t>(text, what, ErrorKind::kInvalidArgument); },
      py::arg("text"), py::arg("what"),
      "An unsigned 64-bit decimal by the one number rule; raises InvalidArgumentError naming `what` otherwise.");
  m.def(
      "try_parse_decimal", [](const std::string& text) -> std::optional<uint64_t> { return try_parse_decimal(text); }, py::arg("text"),
      "The value of `text` by the one number rule, or None when it is not plain decimal digits in range.");
}

}  // namespace deltasync::torch_ext
