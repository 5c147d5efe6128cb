// A Python object owned from C++ callbacks that may be destroyed on any thread, with or without
// the GIL (an upload thread, a destructor that released the GIL to join one): the last owner
// takes the GIL to release it.
#pragma once
#include <pybind11/pybind11.h>

#include <memory>

namespace deltasync::torch_ext {

inline std::shared_ptr<pybind11::object> hold_with_gil(pybind11::object object) {
  return std::shared_ptr<pybind11::object>(new pybind11::object(std::move(object)), [](pybind11::object* p) {
    pybind11::gil_scoped_acquire gil;
    delete p;
  });
}

}  // namespace deltasync::torch_ext
