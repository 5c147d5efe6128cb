// deltasync's element types (core/dtype.hpp: names, widths, which are weights) paired with
// torch's: the one place that pairs them. The Python package derives its dtype maps from this
// (dtype_table() in the native module, deltasync/_dtypes.py).
#pragma once
#include <c10/core/ScalarType.h>

#include <optional>

#include "core/dtype.hpp"

namespace deltasync::torch_ext {

c10::ScalarType torch_dtype(DType t);
std::optional<DType> deltasync_dtype(c10::ScalarType t);

}  // namespace deltasync::torch_ext
