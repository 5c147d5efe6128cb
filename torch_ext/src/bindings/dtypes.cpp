// The dtype table for Python: (safetensors name, bytes per element, weight?, torch dtype) per
// DType, from core/dtype.hpp and torch_dtype.hpp, so the package has no table of its own.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

#include "bindings/module.hpp"
#include "torch_dtype.hpp"

namespace py = pybind11;

namespace deltasync::torch_ext {

void bind_dtypes(py::module_& m) {
  m.def(
      "dtype_table",
      [] {
        std::vector<std::tuple<std::string, uint32_t, bool, at::ScalarType>> rows;
        for (DType d : all_dtypes()) rows.emplace_back(std::string(dtype_name(d)), dtype_width(d), is_weight_dtype(d), torch_dtype(d));
        return rows;
      },
      "(safetensors name, bytes per element, is a weight dtype, torch dtype) of every dtype deltasync reads.");
}

}  // namespace deltasync::torch_ext
