// Full digests of host tensors on the chosen backend: the CPU twin, or the GPU digest kernels
// after copying the tensors to the device in batches. Both give the same bits.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "backend.hpp"
#include "core/tensor.hpp"

namespace deltasync::cli {

// out[t] = digest of tensors[t] (host memory, e.g. a mapped file). Throws Error naming a tensor
// whose element width is not 1, 2 or 4 bytes.
std::vector<uint64_t> digests_on(Backend backend, std::span<const ConstTensorRef> tensors);

}  // namespace deltasync::cli
