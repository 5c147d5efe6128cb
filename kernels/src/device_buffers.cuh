// The growable arrays of the public API (deltasync/cuda/buffers.hpp), under the names the
// dispatch code uses.
#pragma once
#include "deltasync/cuda/buffers.hpp"

namespace deltasync::cuda::detail {

using cuda::DeviceMemory;
using cuda::GrowableArray;
using cuda::PinnedMemory;
template <typename T>
using DeviceArray = cuda::DeviceArray<T>;
template <typename T>
using PinnedArray = cuda::PinnedArray<T>;

}  // namespace deltasync::cuda::detail
