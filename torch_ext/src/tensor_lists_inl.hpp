// Template part of tensor_lists.hpp.
#pragma once
#include <c10/util/Exception.h>

#include "core/error.hpp"

namespace deltasync::torch_ext {

template <class Fn>
decltype(auto) translate_errors(const char* op, Fn&& fn) {
  try {
    return fn();
  } catch (const deltasync::Error& e) {
    TORCH_CHECK(false, op, ": ", e.what());
  }
}

}  // namespace deltasync::torch_ext
