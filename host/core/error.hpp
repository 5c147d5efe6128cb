// One exception type for every user-facing failure. The message is a single line that names the
// file or tensor at fault and the reason, so a CLI can print it as is. The kind says what went
// wrong in a way callers can act on without reading the message (the Python bindings raise one
// exception class per kind).
#pragma once
#include <stdexcept>
#include <string>

namespace deltasync {

enum class ErrorKind {
  kGeneral,           // anything else (internal limits, I/O)
  kInvalidArgument,   // a caller's argument that cannot work (a version not newer, an unknown URL scheme)
  kBadInput,          // a file, delta, anchor or manifest that is corrupt or does not fit the model
  kWrongBase,         // a delta made for other weights than the receiver holds
  kIntegrity,         // weights that do not hash to what a delta or manifest promised
  kNotFound,          // an object the store does not have
  kStoreUnavailable,  // the store did not answer (transport errors, 5xx) after every retry
  kCredentials,       // the store refused the credentials (401/403) or none were given
  kUnsupported,       // the store cannot do what was asked (e.g. list over plain HTTP)
};

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what, ErrorKind kind = ErrorKind::kGeneral) : std::runtime_error(what), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

// Shorthands for the kinds thrown from many places.
class BadInputError : public Error {
 public:
  explicit BadInputError(const std::string& what) : Error(what, ErrorKind::kBadInput) {}
};

}  // namespace deltasync
