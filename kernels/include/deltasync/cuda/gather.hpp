// Reading the bits at given positions of several device tensors into one device buffer: the
// element-wise read a mapped receiver needs (the bits a delta replaces, to rebase its values,
// hash them and roll back). Includable from plain C++.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>

#include "core/tensor.hpp"

namespace deltasync::cuda {

class Gatherer {
 public:
  Gatherer();
  ~Gatherer();
  Gatherer(const Gatherer&) = delete;
  Gatherer& operator=(const Gatherer&) = delete;

  // Queues on `stream`: out[t] receives sources[t]'s elements at positions[t]'s indices (device
  // pointers everywhere; `out[t]` has room for count × width bytes, width-aligned). Positions
  // outside a tensor read as zeros (callers validate them). The job table is staged in pinned
  // memory owned by the gatherer: the previous call's stream must have passed it (the caller
  // synchronizes before reading the result anyway).
  cudaError_t gather(std::span<const ConstTensorRef> sources, std::span<const PatchRef> positions,
                     std::span<uint8_t* const> out, cudaStream_t stream);

 private:
  struct State;
  State* state_;
};

}  // namespace deltasync::cuda
