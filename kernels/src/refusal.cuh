// How a dispatcher refuses its arguments without throwing (the error convention of the public
// API, deltasync/cuda/engine.hpp): it records the one-line reason for take_refusal() and returns
// cudaErrorInvalidValue, which the caller (host/engine/cuda) turns into the project's Error.
#pragma once
#include <cuda_runtime_api.h>

#include <string>

// Returns from the enclosing dispatcher with the error of a CUDA call or a refusal.
#define DELTASYNC_RETURN_IF_ERROR(expr)         \
  do {                                          \
    const cudaError_t status_ = (expr);         \
    if (status_ != cudaSuccess) return status_; \
  } while (0)

namespace deltasync::cuda::detail {

cudaError_t refuse(std::string reason);

}  // namespace deltasync::cuda::detail
