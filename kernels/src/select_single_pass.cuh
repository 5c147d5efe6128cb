// The single-pass select (SelectStrategy::kSinglePass): one block of 128 threads per chunk, CUB's
// decoupled look-back for the running count, every input byte read once, no workspace
// proportional to the model. Then a finish kernel, O(changed), brings the shadow up to date (it
// cannot be written during the select: the count is only known to fit the output buffers at the
// end) and, for a set that mixes element widths, packs the values per tensor (the select wrote
// them at the stride of the widest width, into scratch).
//
// Measured on an H200 (2^28 bf16, 1% changed): 0.41 of device-copy bandwidth, bound by the
// latency each chunk spends loading, looking back and writing with few chunks in flight.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cub/agent/single_pass_scan_operators.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda/std/functional>

#include "encode_kernels.cuh"

namespace deltasync::cuda::detail {

// Decoupled look-back state: one status word + running count per chunk.
using SelectTileState = cub::ScanTileState<unsigned long long>;

struct SinglePassParams {
  const uint32_t* chunk_tensor;
  const EncodeTensor* tensors;
  SelectTileState tile_state;
  uint64_t num_chunks;
  uint64_t* chunk_prefix;  // [num_chunks]: changed elements in all chunks before chunk c
  int64_t* indices;        // [capacity]: local index of the i-th changed element of the set
  uint8_t* values;         // [capacity * value_stride]: its new bits, at i * value_stride
  uint8_t* base_values;    // [capacity * value_stride]: the shadow's bits
  uint32_t value_stride;   // the widest width of the set (= every width when they are equal)
  int64_t capacity;
  EncodeCounts* counts;    // num_selected written by the last chunk
};

__global__ void init_single_pass_kernel(SelectTileState tile_state, int num_tiles) {
  tile_state.InitializeStatus(num_tiles);
}

// Writes the changed elements of this thread's word from output slot first_output on: local
// index, new bits, base bits (re-read: the lines were just loaded, so these hit L1 or L2). Slots
// past the capacity are dropped (the host grows and reruns).
template <int kWidth>
__device__ __forceinline__ void write_strided(const SinglePassParams& p, const ChunkView& v, uint32_t word,
                                              uint64_t first_output) {
  uint64_t i = first_output;
  while (word != 0) {
    const uint32_t bit = __ffs(word) - 1;
    word &= word - 1;
    if (i >= static_cast<uint64_t>(p.capacity)) return;
    const uint32_t e = threadIdx.x * kElementsPerThread + bit;
    p.indices[i] = static_cast<int64_t>(v.local0 + e);
    store_element<kWidth>(p.values + i * p.value_stride, v.current + e * kWidth);
    store_element<kWidth>(p.base_values + i * p.value_stride, v.shadow + e * kWidth);
    ++i;
  }
}

__global__ void __launch_bounds__(kChunkThreads) single_pass_select_kernel(SinglePassParams p) {
  using BlockScan = cub::BlockScan<unsigned long long, kChunkThreads>;
  using LookBack = cub::TilePrefixCallbackOp<unsigned long long, ::cuda::std::plus<>, SelectTileState>;
  __shared__ uint32_t mask_words[kChunkThreads];
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ typename LookBack::TempStorage look_back_storage;

  const int tile = static_cast<int>(blockIdx.x);
  const uint64_t chunk = blockIdx.x;
  const ChunkView v = view_chunk(p.tensors, p.chunk_tensor, p.num_chunks, chunk);
  chunk_mask<2 * 4>(v, threadIdx.x, mask_words);  // every granule's loads at once
  __syncthreads();
  const uint32_t word = mask_words[threadIdx.x];
  const unsigned long long count = __popc(word);
  unsigned long long first_output = 0;
  if (tile == 0) {
    unsigned long long chunk_total = 0;
    BlockScan(scan_storage).ExclusiveSum(count, first_output, chunk_total);
    if (threadIdx.x == 0) p.tile_state.SetInclusive(0, chunk_total);
  } else {
    LookBack look_back(p.tile_state, look_back_storage, ::cuda::std::plus<>{}, tile);
    BlockScan(scan_storage).ExclusiveSum(count, first_output, look_back);
  }
  if (threadIdx.x == 0) p.chunk_prefix[chunk] = first_output;
  if (chunk + 1 == p.num_chunks && threadIdx.x == kChunkThreads - 1)
    p.counts->num_selected = static_cast<int64_t>(first_output + count);
  switch (v.width) {
    case 1: write_strided<1>(p, v, word, first_output); break;
    case 2: write_strided<2>(p, v, word, first_output); break;
    default: write_strided<4>(p, v, word, first_output); break;
  }
}

// Temporary storage of the look-back for num_chunks tiles.
inline cudaError_t single_pass_tile_state_bytes(uint64_t num_chunks, size_t& bytes) {
  return SelectTileState::AllocationSize(static_cast<int>(num_chunks), bytes);
}

// Launcher (num_chunks >= 1, at most 2^31 - 257: encoder.cu, kMaxChunks); `tile_storage` holds
// single_pass_tile_state_bytes bytes.
inline cudaError_t single_pass_select(SinglePassParams p, void* tile_storage, size_t tile_storage_bytes,
                                      cudaStream_t stream) {
  const int num_tiles = static_cast<int>(p.num_chunks);
  cudaError_t err = p.tile_state.Init(num_tiles, tile_storage, tile_storage_bytes);
  if (err != cudaSuccess) return err;
  constexpr unsigned kInitThreads = 256;
  init_single_pass_kernel<<<(num_tiles + kInitThreads - 1) / kInitThreads, kInitThreads, 0, stream>>>(
      p.tile_state, num_tiles);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  single_pass_select_kernel<<<num_tiles, kChunkThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// Finish: the shadow catches up at the changed positions (its old bits are already in
// base_values), and a mixed-width set has its values packed per tensor.

struct FinishParams {
  const EncodeTensor* tensors;
  uint64_t num_tensors;
  const uint64_t* offsets;
  const uint64_t* value_offsets;
  const EncodeCounts* counts;
  int64_t capacity;
  const int64_t* indices;
  const uint8_t* strided_values;  // as the select wrote them: i * value_stride
  const uint8_t* strided_base_values;
  uint32_t value_stride;
  uint8_t* packed_values;  // nullptr when every width equals value_stride (already packed)
  uint8_t* packed_base_values;
};

__global__ void finish_single_pass_kernel(FinishParams p) {
  const int64_t selected = p.counts->num_selected;
  if (selected > p.capacity) return;
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < static_cast<uint64_t>(selected);
       i += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t t = last_not_greater(p.offsets, p.num_tensors, i);
    const EncodeTensor& tensor = p.tensors[t];
    const uint64_t local = static_cast<uint64_t>(p.indices[i]);
    const uint8_t* value = p.strided_values + i * p.value_stride;
    copy_element(value, tensor.shadow + local * tensor.width, tensor.width);
    if (p.packed_values != nullptr) {
      const uint64_t packed = p.value_offsets[t] + (i - p.offsets[t]) * tensor.width;
      copy_element(value, p.packed_values + packed, tensor.width);
      copy_element(p.strided_base_values + i * p.value_stride, p.packed_base_values + packed, tensor.width);
    }
  }
}

inline cudaError_t finish_single_pass(const FinishParams& p, int sm_count, cudaStream_t stream) {
  if (p.capacity == 0) return cudaSuccess;
  constexpr unsigned kThreads = 256;
  finish_single_pass_kernel<<<grid_for(static_cast<uint64_t>(p.capacity), kThreads, sm_count), kThreads, 0,
                              stream>>>(p);
  return cudaGetLastError();
}

}  // namespace deltasync::cuda::detail
