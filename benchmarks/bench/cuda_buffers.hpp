// Device and pinned host buffers for the CUDA benchmarks, and the one stream they are timed on
// (CUDA events around the region, the L2 flushed before every sample so each starts cold, as a
// training step's encode does). Shared by every *_cuda.cpp benchmark file so they all measure the
// same way.
#pragma once
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "deltasync/cuda/engine.hpp"
#include "engine/cuda/cuda_calls.hpp"

namespace deltasync::bench {

// Where a CudaBytes buffer lives: device memory (cudaMalloc), or page-locked host memory
// (cudaMallocHost), which a device-to-host copy needs to run at full speed.
enum class CudaMemory { Device, Pinned };

// An owned CUDA allocation of at least one byte (so that a zero-sized buffer still has a valid
// address).
template <CudaMemory kMemory>
class CudaBytes {
 public:
  explicit CudaBytes(size_t bytes) : size_(bytes) {
    if constexpr (kMemory == CudaMemory::Device)
      cuda::check(cudaMalloc(&ptr_, std::max<size_t>(bytes, 1)), "bench: cudaMalloc");
    else
      cuda::check(cudaMallocHost(&ptr_, std::max<size_t>(bytes, 1)), "bench: cudaMallocHost");
  }
  ~CudaBytes() {
    if constexpr (kMemory == CudaMemory::Device)
      cudaFree(ptr_);
    else
      cudaFreeHost(ptr_);
  }
  CudaBytes(const CudaBytes&) = delete;
  CudaBytes& operator=(const CudaBytes&) = delete;
  uint8_t* data() const { return static_cast<uint8_t*>(ptr_); }
  size_t size() const { return size_; }

 private:
  void* ptr_ = nullptr;
  size_t size_;
};

using DeviceBytes = CudaBytes<CudaMemory::Device>;
using PinnedBytes = CudaBytes<CudaMemory::Pinned>;

// One stream, a pair of events and the L2-flush buffer, shared by all CUDA benchmarks (created
// on first use, so a run without a GPU never touches the runtime).
class Gpu {
 public:
  static Gpu& get() {
    static Gpu gpu;
    return gpu;
  }
  cudaStream_t stream() const { return stream_; }

  // Seconds of region() by CUDA events on stream(), cold L2. `region` queues work on stream()
  // (it may synchronize inside, as Encoder::encode does once).
  template <class Fn>
  double time(Fn&& region) {
    cuda::check(cudaMemsetAsync(flush_->data(), 0, flush_->size(), stream_), "bench: L2 flush");
    cuda::check(cudaEventRecord(begin_, stream_), "bench: cudaEventRecord");
    region();
    cuda::check(cudaEventRecord(end_, stream_), "bench: cudaEventRecord");
    cuda::check(cudaEventSynchronize(end_), "bench: cudaEventSynchronize");
    float ms = 0;
    cuda::check(cudaEventElapsedTime(&ms, begin_, end_), "bench: cudaEventElapsedTime");
    return ms / 1e3;
  }
  void sync() { cuda::check(cudaStreamSynchronize(stream_), "bench: cudaStreamSynchronize"); }

 private:
  Gpu() {
    int device = 0, l2 = 0;
    cuda::check(cudaGetDevice(&device), "bench: cudaGetDevice");
    cuda::check(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device), "bench: L2 size");
    // Twice the L2 evicts whatever the previous sample left there.
    flush_ = std::make_unique<DeviceBytes>(std::max<size_t>(2 * static_cast<size_t>(l2), size_t{1} << 20));
    cuda::check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "bench: cudaStreamCreate");
    cuda::check(cudaEventCreate(&begin_), "bench: cudaEventCreate");
    cuda::check(cudaEventCreate(&end_), "bench: cudaEventCreate");
  }
  std::unique_ptr<DeviceBytes> flush_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t begin_ = nullptr, end_ = nullptr;
};

}  // namespace deltasync::bench
