// Small pieces of the CUDA backend's public API that launch nothing: device discovery and the
// reasons of refused arguments.
#include <string>
#include <utility>

#include "deltasync/cuda/engine.hpp"
#include "refusal.cuh"

namespace deltasync::cuda {
namespace {

// Per thread, as cudaGetLastError is: the dispatchers are used from one thread at a time each.
thread_local std::string last_refusal;

}  // namespace

bool device_available() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // "no driver" / "no device" must not stay sticky for later calls
    return false;
  }
  return count > 0;
}

std::string take_refusal() { return std::exchange(last_refusal, std::string()); }

cudaError_t detail::refuse(std::string reason) {
  last_refusal = std::move(reason);
  return cudaErrorInvalidValue;
}

}  // namespace deltasync::cuda
