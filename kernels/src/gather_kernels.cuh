// Gathering the bits at a list of positions of several device tensors: what a verified apply
// saves before it scatters (to roll back), and what a mapped receiver reads to rebase and hash.
#pragma once
#include <cstdint>

namespace deltasync::cuda::detail {
// Internal linkage: each .cu that launches these gets its own copy (no separable compilation).
namespace {

constexpr unsigned kSaveThreads = 256;
constexpr uint64_t kSaveTile = uint64_t{1} << 12;  // changed positions per block visit

struct SaveJob {
  const uint8_t* data;   // target tensor
  const void* indices;   // patch positions (int32 or int64)
  uint8_t* saved;        // where the bits at those positions go (count × width)
  uint64_t count;
  uint64_t numel;
  uint64_t first_tile;
  uint32_t width;
  uint32_t index_width;
};

__device__ uint32_t save_job_of_tile(const SaveJob* jobs, uint32_t num_jobs, uint64_t tile) {
  uint32_t lo = 0, hi = num_jobs;
  while (hi - lo > 1) {
    const uint32_t mid = lo + (hi - lo) / 2;
    if (jobs[mid].first_tile <= tile) lo = mid;
    else hi = mid;
  }
  return lo;
}

// saved[k] = data[indices[k]]; positions outside the tensor (which the Applier will reject,
// writing nothing) save zeros instead of reading out of bounds.
__global__ void __launch_bounds__(kSaveThreads) save_kernel(const SaveJob* jobs, uint32_t num_jobs, uint64_t num_tiles) {
  for (uint64_t tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
    const SaveJob job = jobs[save_job_of_tile(jobs, num_jobs, tile)];
    const uint64_t begin = (tile - job.first_tile) * kSaveTile;
    const uint64_t end = min(begin + kSaveTile, job.count);
    for (uint64_t k = begin + threadIdx.x; k < end; k += kSaveThreads) {
      const uint64_t i = job.index_width == 4
                             ? static_cast<uint64_t>(static_cast<int64_t>(static_cast<const int32_t*>(job.indices)[k]))
                             : static_cast<uint64_t>(static_cast<const int64_t*>(job.indices)[k]);
      const bool inside = i < job.numel;
      switch (job.width) {
        case 1: job.saved[k] = inside ? job.data[i] : 0; break;
        case 2:
          reinterpret_cast<uint16_t*>(job.saved)[k] = inside ? reinterpret_cast<const uint16_t*>(job.data)[i] : 0;
          break;
        default:
          reinterpret_cast<uint32_t*>(job.saved)[k] = inside ? reinterpret_cast<const uint32_t*>(job.data)[i] : 0;
          break;
      }
    }
  }
}
}  // namespace
}  // namespace deltasync::cuda::detail
