// Kernels and launchers of tiled compact tensors (compact_tile_kernels.cuh says what each does).
#include "compact_tile_kernels.cuh"

namespace deltasync::cuda::detail {
namespace compact_tiles {
namespace {

__device__ inline bool decode_failed(const CompactDecodeStatus* status) {
  return status != nullptr && (status->first_bad_block != kNoBadBlock || status->first_unordered_block != kNoBadBlock ||
                               status->first_crossing_block != kNoBadBlock);
}

// counts[s] for every segment of the launch (one extra, zero, at the end: the scan's total).
// After a failed decode every count is zero (the positions were not all written), so that the
// scan after this kernel reads written memory.
template <bool kBandMajor>
__global__ void segment_counts(const TiledTensor* tensors, uint32_t num_tensors, uint64_t num_segments, uint64_t* counts,
                               const CompactDecodeStatus* status) {
  const bool failed = decode_failed(status);
  for (uint64_t s = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; s <= num_segments; s += uint64_t{gridDim.x} * blockDim.x) {
    if (s == num_segments || failed) {
      counts[s] = 0;
      continue;
    }
    const TiledTensor& t = tensors[tensor_of(tensors, num_tensors, s, &TiledTensor::first_segment)];
    counts[s] = kBandMajor ? band_row_count(t, s - t.first_segment) : row_band_count(t, s - t.first_segment);
  }
}

template <bool kToCoded>
__global__ void reorder(const TiledTensor* tensors, uint32_t num_tensors, uint64_t num_changes, const uint64_t* segment_start,
                        const CompactDecodeStatus* status) {
  if (decode_failed(status)) return;
  for (uint64_t c = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; c < num_changes; c += uint64_t{gridDim.x} * blockDim.x) {
    const TiledTensor& t = tensors[tensor_of(tensors, num_tensors, c, &TiledTensor::first_change)];
    if (kToCoded) {
      to_coded_one(t, c - t.first_change, segment_start);
    } else {
      to_flat_one(t, c - t.first_change, segment_start);
    }
  }
}

__global__ void tile_starts(const TiledTensor* tensors, uint32_t num_tensors, uint64_t num_tiles, uint64_t* starts) {
  for (uint64_t j = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x; j < num_tiles; j += uint64_t{gridDim.x} * blockDim.x) {
    const TiledTensor& t = tensors[tensor_of(tensors, num_tensors, j, &TiledTensor::first_tile)];
    const int64_t* coded = t.tiles.bands > 1 ? t.out_positions : t.positions;
    starts[j] = tile_start(t, coded, static_cast<uint32_t>(j - t.first_tile));
  }
}

}  // namespace
}  // namespace compact_tiles

namespace {

unsigned tile_grid(uint64_t items) {
  constexpr uint64_t kMaxBlocks = 4096;
  const uint64_t blocks = (items + 255) / 256;
  return static_cast<unsigned>(blocks == 0 ? 1 : (blocks < kMaxBlocks ? blocks : kMaxBlocks));
}

}  // namespace

cudaError_t launch_tile_segment_counts(bool band_major, const TiledTensor* tensors, uint32_t num_tensors,
                                              uint64_t num_segments, uint64_t* counts, const CompactDecodeStatus* status,
                                              cudaStream_t stream) {
  if (num_tensors == 0) return cudaSuccess;
  if (band_major)
    compact_tiles::segment_counts<true><<<tile_grid(num_segments + 1), 256, 0, stream>>>(tensors, num_tensors, num_segments, counts, status);
  else
    compact_tiles::segment_counts<false><<<tile_grid(num_segments + 1), 256, 0, stream>>>(tensors, num_tensors, num_segments, counts, status);
  return cudaGetLastError();
}

cudaError_t launch_tile_reorder(bool to_coded, const TiledTensor* tensors, uint32_t num_tensors, uint64_t num_changes,
                                       const uint64_t* segment_start, const CompactDecodeStatus* status, cudaStream_t stream) {
  if (num_tensors == 0 || num_changes == 0) return cudaSuccess;
  if (to_coded)
    compact_tiles::reorder<true><<<tile_grid(num_changes), 256, 0, stream>>>(tensors, num_tensors, num_changes, segment_start, status);
  else
    compact_tiles::reorder<false><<<tile_grid(num_changes), 256, 0, stream>>>(tensors, num_tensors, num_changes, segment_start, status);
  return cudaGetLastError();
}

cudaError_t launch_tile_starts(const TiledTensor* tensors, uint32_t num_tensors, uint64_t num_tiles, uint64_t* starts,
                                      cudaStream_t stream) {
  if (num_tensors == 0) return cudaSuccess;
  compact_tiles::tile_starts<<<tile_grid(num_tiles), 256, 0, stream>>>(tensors, num_tensors, num_tiles, starts);
  return cudaGetLastError();
}

}  // namespace deltasync::cuda::detail
