// Growable device and pinned-host arrays, used by the CUDA backend's dispatch layer and by the
// host code that stages data for it (engine/cuda). Both only ever grow: a step that
// needs more than any step before frees the old block and allocates the larger one, so a warm
// encoder or applier performs no cudaMalloc/cudaHostAlloc per step. Contents are NOT preserved
// across growth (every user rewrites the buffer after growing it).
//
// Growth frees the old block at once, so the owner must first make sure no queued copy or kernel
// still touches it (the encoder and applier wait on events for that). cudaFree and cudaFreeHost
// do synchronize in practice, but CUDA documents no such guarantee, so it is not relied upon.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

namespace deltasync::cuda {

// Where a GrowableArray lives: device memory, or page-locked host memory that copies to and
// from the device can run asynchronously against.
struct DeviceMemory {
  static cudaError_t allocate(void** p, size_t bytes) { return cudaMalloc(p, bytes); }
  static void release(void* p) { cudaFree(p); }
};
struct PinnedMemory {
  static cudaError_t allocate(void** p, size_t bytes) { return cudaHostAlloc(p, bytes, cudaHostAllocDefault); }
  static void release(void* p) { cudaFreeHost(p); }
};

template <typename T, typename Memory>
class GrowableArray {
 public:
  GrowableArray() = default;
  ~GrowableArray() { release(); }
  GrowableArray(const GrowableArray&) = delete;
  GrowableArray& operator=(const GrowableArray&) = delete;

  // Makes room for at least `count` elements; never shrinks.
  cudaError_t reserve(size_t count) {
    if (count <= capacity_) return cudaSuccess;
    release();
    void* raw = nullptr;
    cudaError_t err = Memory::allocate(&raw, count * sizeof(T));
    if (err != cudaSuccess) return err;
    data_ = static_cast<T*>(raw);
    capacity_ = count;
    return cudaSuccess;
  }

  T* data() const { return data_; }
  size_t capacity() const { return capacity_; }
  size_t bytes() const { return capacity_ * sizeof(T); }

 private:
  void release() {
    if (data_ != nullptr) Memory::release(data_);
    data_ = nullptr;
    capacity_ = 0;
  }

  T* data_ = nullptr;
  size_t capacity_ = 0;
};

template <typename T>
using DeviceArray = GrowableArray<T, DeviceMemory>;
template <typename T>
using PinnedArray = GrowableArray<T, PinnedMemory>;

}  // namespace deltasync::cuda
