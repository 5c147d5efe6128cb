// Small pieces of the CUDA backend's public API that launch nothing: device discovery, error
// conversion and the wording of apply failures (identical to the CPU twin's messages).
#include <string>

#include "deltasync/cuda/engine.hpp"
#include "core/error.hpp"

namespace deltasync::cuda {

bool device_available() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // "no driver" / "no device" must not stay sticky for later calls
    return false;
  }
  return count > 0;
}

void check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  throw Error(std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

std::string describe(const ApplyStatus& status, std::span<const TensorRef> targets) {
  if (status.bad_tensor < 0) return "all patches valid";
  const auto t = static_cast<size_t>(status.bad_tensor);
  // Appended piece by piece: GCC 12's -Wrestrict misfires on `"literal" + std::string&&`.
  std::string label = "tensor ";
  if (t < targets.size()) label += targets[t].name; else label += '#' + std::to_string(t);
  label += ": ";
  const uint64_t numel = t < targets.size() ? targets[t].numel : 0;
  const uint32_t width = t < targets.size() ? targets[t].width : 0;
  switch (status.reason) {
    case kIndexOutOfRange:
      return label + "index " + std::to_string(status.bad_position) + " out of range [0, " + std::to_string(numel) +
             ")";
    case kIndexNotAscending:
      return label + "indices not strictly ascending at position " + std::to_string(status.bad_position);
    case kWidthMismatch:
      // bad_position carries the width of the offending values.
      return label + "values are " + std::to_string(status.bad_position) + "-byte but the tensor is " +
             std::to_string(width) + "-byte";
    default:
      return label + "invalid patch (reason " + std::to_string(status.reason) + ")";
  }
}

}  // namespace deltasync::cuda
