#include <cuda_runtime.h>

#include "deltasync/cuda/gather.hpp"
#include "device_buffers.cuh"
#include "gather_kernels.cuh"

namespace deltasync::cuda {

struct Gatherer::State {
  detail::PinnedArray<detail::SaveJob> host_jobs;
  detail::DeviceArray<detail::SaveJob> device_jobs;
};

Gatherer::Gatherer() : state_(new State) {}
Gatherer::~Gatherer() { delete state_; }

cudaError_t Gatherer::gather(std::span<const ConstTensorRef> sources, std::span<const PatchRef> positions,
                             std::span<uint8_t* const> out, cudaStream_t stream) {
  const size_t T = sources.size();
  if (positions.size() != T || out.size() != T) return cudaErrorInvalidValue;
  if (T == 0) return cudaSuccess;
  State& s = *state_;
  if (cudaError_t e = s.host_jobs.reserve(T); e != cudaSuccess) return e;
  if (cudaError_t e = s.device_jobs.reserve(T); e != cudaSuccess) return e;
  uint64_t tiles = 0;
  for (size_t t = 0; t < T; ++t) {
    const uint32_t w = sources[t].width;
    if (w != 1 && w != 2 && w != 4) return cudaErrorInvalidValue;
    s.host_jobs.data()[t] = detail::SaveJob{static_cast<const uint8_t*>(sources[t].data), positions[t].indices, out[t],
                                            positions[t].count, sources[t].numel, tiles, w, positions[t].index_width};
    tiles += (positions[t].count + detail::kSaveTile - 1) / detail::kSaveTile;
  }
  if (cudaError_t e = cudaMemcpyAsync(s.device_jobs.data(), s.host_jobs.data(), T * sizeof(detail::SaveJob),
                                      cudaMemcpyHostToDevice, stream);
      e != cudaSuccess)
    return e;
  if (tiles == 0) return cudaSuccess;
  const uint64_t blocks = tiles < 65535 ? tiles : 65535;
  detail::save_kernel<<<static_cast<unsigned>(blocks), detail::kSaveThreads, 0, stream>>>(s.device_jobs.data(), static_cast<uint32_t>(T), tiles);
  return cudaGetLastError();
}

}  // namespace deltasync::cuda
