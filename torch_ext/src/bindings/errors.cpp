// deltasync::Error -> the Python exception class of its kind (deltasync/errors.py), so Python
// callers catch what they can act on instead of matching messages; c10::Error -> RuntimeError.
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>

#include "bindings/module.hpp"
#include "core/error.hpp"

namespace py = pybind11;

namespace deltasync::torch_ext {
namespace {

const char* class_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kBadInput: return "BadDeltaError";
    case ErrorKind::kInvalidArgument: return "InvalidArgumentError";
    case ErrorKind::kWrongBase: return "WrongBaseError";
    case ErrorKind::kIntegrity: return "IntegrityError";
    case ErrorKind::kNotFound: return "NotFoundError";
    case ErrorKind::kStoreUnavailable: return "StoreUnavailableError";
    case ErrorKind::kCredentials: return "CredentialsError";
    case ErrorKind::kUnsupported: return "UnsupportedError";
    case ErrorKind::kGeneral: break;
  }
  return "DeltaSyncError";
}

}  // namespace

void bind_errors(py::module_& m) {
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      py::object cls = py::module_::import("deltasync.errors").attr(class_name(e.kind()));
      PyErr_SetString(cls.ptr(), e.what());
    } catch (const c10::Error& e) {
      // An argument check (TORCH_CHECK) of a plain binding: the one-line message, as torch's
      // own functions raise it, without the C++ backtrace.
      PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });
  m.def("_raise_for_test", [](int kind, const std::string& what) { throw Error(what, static_cast<ErrorKind>(kind)); },
        "Raises the Python exception for an error kind (tests of the translation).");
}

}  // namespace deltasync::torch_ext
