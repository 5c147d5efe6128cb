#include "core/tensor_meta.hpp"

#include "core/error.hpp"

namespace deltasync {

uint64_t TensorMeta::numel() const {
  uint64_t n = 1;
  for (uint64_t dim : shape) {
    if (__builtin_mul_overflow(n, dim, &n))
      throw BadInputError("tensor " + name + ": shape " + shape_text(shape) + " has more than 2^64 elements");
  }
  return n;
}

std::string shape_text(std::span<const uint64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

}  // namespace deltasync
