#include "digest_backend.hpp"

#include <algorithm>

#include "codec/digest.hpp"
#include "core/error.hpp"

#ifdef DELTASYNC_WITH_CUDA
#include <cuda_runtime_api.h>

#include "deltasync/cuda/digest.hpp"
#include "deltasync/cuda/engine.hpp"
#endif

namespace deltasync::cli {

namespace {

#ifdef DELTASYNC_WITH_CUDA
// Device memory used per batch: big enough to keep the copy engine busy, small enough to fit
// next to a running inference server. A tensor larger than this gets a batch of its own.
constexpr uint64_t kBatchBytes = uint64_t{1} << 30;

uint64_t padded(uint64_t bytes) { return (bytes + 255) / 256 * 256; }

std::vector<uint64_t> digests_cuda(std::span<const ConstTensorRef> tensors) {
  uint64_t largest = 0, total = 0;
  for (const auto& t : tensors) {
    if (t.width != 1 && t.width != 2 && t.width != 4)
      throw Error("digest: tensor " + std::string(t.name) + " has " + std::to_string(t.width) +
                  "-byte elements; digests cover 1-, 2- and 4-byte elements");
    largest = std::max(largest, padded(t.numel * t.width));
    total += padded(t.numel * t.width);
  }
  const uint64_t capacity = std::max<uint64_t>(std::min(total, kBatchBytes), std::max<uint64_t>(largest, 256));
  void* buffer = nullptr;
  uint64_t* results = nullptr;
  cudaStream_t stream = nullptr;
  std::vector<uint64_t> out(tensors.size(), 0);
  auto cleanup = [&] {
    if (stream) cudaStreamDestroy(stream);
    if (buffer) cudaFree(buffer);
    if (results) cudaFree(results);
  };
  try {
    cuda::check(cudaMalloc(&buffer, capacity), "digest: cudaMalloc");
    cuda::check(cudaMalloc(reinterpret_cast<void**>(&results), std::max<size_t>(tensors.size(), 1) * sizeof(uint64_t)),
                "digest: cudaMalloc");
    cuda::check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "digest: cudaStreamCreate");
    cuda::Digester digester;
    // Batches of consecutive tensors that fit in `capacity`; each batch is copied in, then
    // digested with one launch into results[first ..].
    for (size_t first = 0; first < tensors.size();) {
      std::vector<ConstTensorRef> batch;
      uint64_t used = 0;
      size_t t = first;
      for (; t < tensors.size() && (batch.empty() || used + padded(tensors[t].numel * tensors[t].width) <= capacity); ++t) {
        ConstTensorRef dev = tensors[t];
        dev.data = static_cast<uint8_t*>(buffer) + used;
        const uint64_t bytes = tensors[t].numel * tensors[t].width;
        if (bytes) cuda::check(cudaMemcpyAsync(const_cast<void*>(dev.data), tensors[t].data, bytes, cudaMemcpyHostToDevice, stream),
                               "digest: copy to device");
        batch.push_back(dev);
        used += padded(bytes);
      }
      cuda::check(digester.digest(batch, results + first, stream), "digest");
      // The next batch overwrites the buffer: wait for this one.
      cuda::check(cudaStreamSynchronize(stream), "digest");
      first = t;
    }
    cuda::check(cudaMemcpy(out.data(), results, tensors.size() * sizeof(uint64_t), cudaMemcpyDeviceToHost),
                "digest: copy to host");
  } catch (...) {
    cleanup();
    throw;
  }
  cleanup();
  return out;
}
#endif

}  // namespace

std::vector<uint64_t> digests_on(Backend backend, std::span<const ConstTensorRef> tensors) {
#ifdef DELTASYNC_WITH_CUDA
  if (backend == Backend::Cuda && !tensors.empty()) return digests_cuda(tensors);
#else
  (void)backend;
#endif
  return digest_tensors(tensors);
}

}  // namespace deltasync::cli
