// Copying one element of 1, 2 or 4 bytes between device buffers.
#pragma once
#include <cstdint>

namespace deltasync::cuda::detail {

// Tensor buffers are width-aligned (checked on the host), but packed value buffers may not be
// (a 4-byte tensor after a 2-byte tensor with an odd count), so a wide access is used only when
// both addresses allow it.
__device__ __forceinline__ void copy_element(const uint8_t* src, uint8_t* dst, uint32_t width) {
  const bool aligned = ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & (width - 1)) == 0;
  if (aligned && width == 2) {
    *reinterpret_cast<uint16_t*>(dst) = *reinterpret_cast<const uint16_t*>(src);
  } else if (aligned && width == 4) {
    *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(src);
  } else {
    for (uint32_t b = 0; b < width; ++b) dst[b] = src[b];
  }
}

}  // namespace deltasync::cuda::detail
