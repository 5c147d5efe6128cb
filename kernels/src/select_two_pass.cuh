// The two-pass select (SelectStrategy::kTwoPass, the default):
//   1. count    every chunk's changed mask -> global memory (1 bit per element) and its count;
//               no block waits for another, so this pass streams at memory bandwidth;
//   2. scan     CUB exclusive scan of the chunk counts (num_chunks + 1 entries: the last is the
//               total), which a one-thread kernel publishes as the number of changed elements;
//   (offsets    per-tensor offsets and value offsets, encode_kernels.cuh)
//   3. write    if the total fits the output buffers: per chunk, a block scan of the mask's
//               popcounts places each changed element; its local index, new bits and base bits
//               (packed per tensor) are written and the shadow catches up, in the same pass.
// Reads each input byte once plus the sectors holding changed elements again (about 15% of a
// bf16 model at 1% changed), for a workspace of 1 bit per element (1/16 of a bf16 model) that
// the single-pass select does without.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_scan.cuh>

#include "encode_kernels.cuh"

namespace deltasync::cuda::detail {

struct TwoPassParams {
  const uint32_t* chunk_tensor;
  const EncodeTensor* tensors;
  uint64_t num_chunks;
  uint32_t* masks;         // [num_chunks * 128]: changed bits, chunk by chunk
  uint64_t* chunk_counts;  // [num_chunks + 1]: changed elements per chunk (the last one 0)
  uint64_t* chunk_prefix;  // [num_chunks + 1]: exclusive scan of chunk_counts (the last: total)
  const uint64_t* offsets;        // [T + 1]: first output slot of each tensor
  const uint64_t* value_offsets;  // [T + 1]: first value byte of each tensor
  int64_t* indices;               // [capacity]
  uint8_t* values;                // [capacity * widest width], packed per tensor
  uint8_t* base_values;
  int64_t capacity;
  EncodeCounts* counts;
};

// Pass 1. Two chunks per block of 256 threads; loads in batches of 4 granules per buffer keep it
// at <= 64 registers, for 4 blocks (1024 threads) per multiprocessor.
constexpr int kCountChunksPerBlock = 2;
constexpr int kCountThreads = kChunkThreads * kCountChunksPerBlock;

__global__ void __launch_bounds__(kCountThreads, 4) count_changed_kernel(TwoPassParams p) {
  constexpr int kWarpsPerChunk = kChunkThreads / 32;
  __shared__ uint32_t mask_words[kCountThreads];
  __shared__ uint32_t warp_counts[kCountThreads / 32];
  const uint32_t part = threadIdx.x / kChunkThreads;
  const uint32_t thread = threadIdx.x % kChunkThreads;
  const uint64_t chunk = uint64_t{blockIdx.x} * kCountChunksPerBlock + part;
  const ChunkView v = view_chunk(p.tensors, p.chunk_tensor, p.num_chunks, chunk);
  chunk_mask<4>(v, thread, mask_words + part * kChunkThreads);  // nothing for a missing chunk
  __syncthreads();
  const uint32_t word = v.width != 0 ? mask_words[threadIdx.x] : 0;
  if (v.width != 0) p.masks[chunk * kChunkThreads + thread] = word;
  const uint32_t warp_count = __reduce_add_sync(0xFFFFFFFFu, static_cast<uint32_t>(__popc(word)));
  if (threadIdx.x % 32 == 0) warp_counts[threadIdx.x / 32] = warp_count;
  __syncthreads();
  if (v.width != 0 && thread == 0) {
    uint64_t total = 0;
    for (int w = 0; w < kWarpsPerChunk; ++w) total += warp_counts[part * kWarpsPerChunk + w];
    p.chunk_counts[chunk] = total;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) p.chunk_counts[p.num_chunks] = 0;  // the scan's total slot
}

__global__ void publish_total_kernel(const uint64_t* chunk_prefix, uint64_t num_chunks, EncodeCounts* counts) {
  counts->num_selected = static_cast<int64_t>(chunk_prefix[num_chunks]);
}

// Pass 3. One chunk per block. Runs after compute_offsets; does nothing after an overflow.
template <int kWidth>
__device__ __forceinline__ void write_packed(const TwoPassParams& p, const ChunkView& v, uint32_t word,
                                             uint64_t first_output, uint64_t packed) {
  uint64_t i = first_output;
  while (word != 0) {
    const uint32_t bit = __ffs(word) - 1;
    word &= word - 1;
    const uint32_t e = threadIdx.x * kElementsPerThread + bit;
    p.indices[i] = static_cast<int64_t>(v.local0 + e);
    // Packed values of a mixed-width set may be unaligned (a 4-byte tensor after an odd count of
    // 2-byte values): copy_element checks; the shadow is width-aligned.
    copy_element(v.current + e * kWidth, p.values + packed, kWidth);
    copy_element(v.shadow + e * kWidth, p.base_values + packed, kWidth);
    store_element<kWidth>(v.shadow + e * kWidth, v.current + e * kWidth);  // after its old bits were read
    ++i;
    packed += kWidth;
  }
}

__global__ void __launch_bounds__(kChunkThreads) write_changed_kernel(TwoPassParams p) {
  using BlockScan = cub::BlockScan<uint32_t, kChunkThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  if (p.counts->num_selected > p.capacity) return;  // the host grows the buffers and reruns
  const uint64_t chunk = blockIdx.x;
  const uint32_t word = p.masks[chunk * kChunkThreads + threadIdx.x];
  uint32_t rank = 0;
  BlockScan(scan_storage).ExclusiveSum(static_cast<uint32_t>(__popc(word)), rank);
  if (word == 0) return;
  const uint32_t t = p.chunk_tensor[chunk];
  const ChunkView v = view_chunk(p.tensors, p.chunk_tensor, p.num_chunks, chunk);
  const uint64_t first_output = p.chunk_prefix[chunk] + rank;
  const uint64_t packed = p.value_offsets[t] + (first_output - p.offsets[t]) * v.width;
  switch (v.width) {
    case 1: write_packed<1>(p, v, word, first_output, packed); break;
    case 2: write_packed<2>(p, v, word, first_output, packed); break;
    default: write_packed<4>(p, v, word, first_output, packed); break;
  }
}

// CUB temporary storage of the chunk-count scan.
inline cudaError_t two_pass_scan_bytes(uint64_t num_chunks, size_t& bytes) {
  bytes = 0;
  return cub::DeviceScan::ExclusiveSum(nullptr, bytes, static_cast<const uint64_t*>(nullptr),
                                       static_cast<uint64_t*>(nullptr), static_cast<int64_t>(num_chunks + 1));
}

// Passes 1 and 2 (num_chunks >= 1): masks, counts, running counts and counts->num_selected.
inline cudaError_t two_pass_count(const TwoPassParams& p, void* scan_temp, size_t scan_temp_bytes,
                                  cudaStream_t stream) {
  const uint64_t blocks = (p.num_chunks + kCountChunksPerBlock - 1) / kCountChunksPerBlock;
  count_changed_kernel<<<static_cast<unsigned>(blocks), kCountThreads, 0, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  err = cub::DeviceScan::ExclusiveSum(scan_temp, scan_temp_bytes, p.chunk_counts, p.chunk_prefix,
                                      static_cast<int64_t>(p.num_chunks + 1), stream);
  if (err != cudaSuccess) return err;
  publish_total_kernel<<<1, 1, 0, stream>>>(p.chunk_prefix, p.num_chunks, p.counts);
  return cudaGetLastError();
}

// Pass 3 (after compute_offsets).
inline cudaError_t two_pass_write(const TwoPassParams& p, cudaStream_t stream) {
  write_changed_kernel<<<static_cast<unsigned>(p.num_chunks), kChunkThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace deltasync::cuda::detail
