// A Python callable as the one-line log the Publisher and Subscriber take. It is called from
// C++ threads (the upload thread among them), so it takes the GIL itself; an exception it raises
// is reported as unraisable instead of breaking an upload.
#pragma once
#include <pybind11/pybind11.h>

#include <functional>
#include <memory>
#include <string>

namespace deltasync::torch_ext {

// A Python object held by C++ callbacks, released with the GIL held: the callbacks may be
// destroyed on any thread, or while the GIL is released (a binding's destructor releases it
// to join threads).
inline std::shared_ptr<pybind11::object> shared_py_object(pybind11::object o) {
  return std::shared_ptr<pybind11::object>(new pybind11::object(std::move(o)), [](pybind11::object* p) {
    pybind11::gil_scoped_acquire gil;
    delete p;
  });
}

inline std::function<void(const std::string&)> log_callback(pybind11::object log) {
  if (log.is_none()) return {};
  auto holder = shared_py_object(std::move(log));
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
