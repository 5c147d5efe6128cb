// A Python callable as the one-line log the Publisher and Subscriber take. It is called from
// C++ threads (the upload thread among them), so it takes the GIL itself; an exception it raises
// is reported as unraisable instead of breaking an upload.
#pragma once
#include <pybind11/pybind11.h>

#include <functional>
#include <string>

#include "bindings/py_holder.hpp"

namespace deltasync::torch_ext {

inline std::function<void(const std::string&)> log_callback(pybind11::object log) {
  if (log.is_none()) return {};
  auto holder = hold_with_gil(std::move(log));
  return [holder](const std::string& line) {
    pybind11::gil_scoped_acquire gil;
    try {
      (*holder)(line);
    } catch (pybind11::error_already_set& e) {
      e.discard_as_unraisable("deltasync log callback");
    }
  };
}

}  // namespace deltasync::torch_ext
