// Name, dtype and shape of one model tensor: what every layer (file formats, codec, engines,
// kernels) needs to know about a tensor besides its memory.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.hpp"

namespace deltasync {

struct TensorMeta {
  std::string name;
  DType dtype;
  std::vector<uint64_t> shape;
  // Product of the dimensions; throws BadInputError naming the tensor past 2^64 elements.
  uint64_t numel() const;
  uint32_t width() const { return dtype_width(dtype); }
};

// "[2, 3]": a shape as error messages and metadata print it.
std::string shape_text(std::span<const uint64_t> shape);

}  // namespace deltasync
