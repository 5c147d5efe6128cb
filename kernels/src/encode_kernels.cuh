// Kernels and launchers of the encode pipeline (diff + compaction + gather + shadow update).
//
// The tensor set is laid out in one virtual "global position" space so that a whole model is a
// single CUB DeviceSelect, not one per tensor: tensor t occupies global positions
// [start[t], start[t] + numel[t]) where every start is a multiple of kChunkElements. A chunk table
// (one uint32 tensor id per chunk) turns a global position into its tensor with one load. The
// tail of a tensor's last chunk is padding that the predicate never selects.
//
// Pipeline (all on one stream, one host synchronization at the end):
//   1. select      positions g with current[g] != shadow[g] (bitwise), ascending, into a
//                  capacity-bounded buffer (writes past capacity are dropped);
//   2. offsets     offsets[t] = lower_bound(positions, start[t]) (positions are sorted);
//   3. value scan  value_offsets = exclusive scan of count[t] * width[t];
//   4. gather      positions -> local indices (in place), packed new values and base values
//                  (the shadow's bits before), then shadow <- current.
// Steps 2-4 do nothing when step 1 overflowed its capacity; the host then grows the buffers and
// reruns the pipeline. That is only correct because step 1 never modifies the shadow.
//
// Performance (unmeasured so far; what to look at on a GPU): steps 2-4 are O(changed elements).
// Step 1 reads 2·N·width bytes, the floor, but evaluates the predicate once per element, on
// CUB's blocked arrangement (each thread owns consecutive positions, so one warp-wide load is
// strided by ITEMS_PER_THREAD·width bytes and leans on L1). For bf16 that is 4 bytes of traffic
// per CUB item, which may leave the select bound by per-item work rather than bandwidth. The
// planned remedy, if measurements say so: select changed 16-byte granules (one uint4 compare per
// item, 8 bf16 elements), then expand each selected granule into its changed elements with an
// exclusive scan of per-granule popcounts; steps 2-4 stay as they are.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_select.cuh>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/tabulate_output_iterator.h>

#include "element_copy.cuh"
#include "launch_config.cuh"

namespace deltasync::cuda::detail {

// 4096-element chunks: the padding wasted per tensor (< 4096 positions the predicate rejects
// without touching memory) is negligible, and the chunk table costs 4 bytes per 4096 elements.
constexpr int kChunkShift = 12;
constexpr uint64_t kChunkElements = uint64_t{1} << kChunkShift;

struct EncodeTensor {
  const uint8_t* current;
  uint8_t* shadow;
  uint64_t numel;
  uint64_t start;  // first global position, a multiple of kChunkElements
  uint32_t width;  // 1, 2 or 4 bytes
};

// Written by the device, read back by the host in the single synchronization of an encode.
struct EncodeCounts {
  int64_t num_selected;  // changed elements (may exceed the output capacity: then rerun)
  uint64_t value_bytes;  // sum over tensors of changed elements × width
};

// ---------------------------------------------------------------------------------------------
// Device helpers

template <typename Word>
__device__ __forceinline__ bool words_differ(const uint8_t* a, const uint8_t* b, uint64_t element) {
  return reinterpret_cast<const Word*>(a)[element] != reinterpret_cast<const Word*>(b)[element];
}

// First index i in sorted [data, data + n) with data[i] >= key.
template <typename T>
__device__ __forceinline__ uint64_t lower_bound(const T* data, uint64_t n, T key) {
  uint64_t lo = 0, hi = n;
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (data[mid] < key) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Last index i in [0, n) with data[i] <= key (data sorted, data[0] <= key).
template <typename T>
__device__ __forceinline__ uint64_t last_not_greater(const T* data, uint64_t n, T key) {
  uint64_t lo = 0, hi = n;  // first index with data[i] > key, minus one
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (data[mid] <= key) lo = mid + 1; else hi = mid;
  }
  return lo - 1;
}

// ---------------------------------------------------------------------------------------------
// Select: predicate and bounded output

// True where the element at global position g differs bitwise between current and shadow.
struct ChangedAtPosition {
  const uint32_t* chunk_tensor;
  const EncodeTensor* tensors;

  __device__ __forceinline__ bool operator()(int64_t g) const {
    const EncodeTensor& t = tensors[chunk_tensor[static_cast<uint64_t>(g) >> kChunkShift]];
    const uint64_t local = static_cast<uint64_t>(g) - t.start;
    if (local >= t.numel) return false;  // padding after the tensor's last element
    switch (t.width) {
      case 1: return words_differ<uint8_t>(t.current, t.shadow, local);
      case 2: return words_differ<uint16_t>(t.current, t.shadow, local);
      default: return words_differ<uint32_t>(t.current, t.shadow, local);
    }
  }
};

// Output of the select: the i-th selected position goes to out[i] when i < capacity and is
// dropped otherwise (the count is still exact, so the host can grow and rerun).
struct StoreWithinCapacity {
  int64_t* out;
  int64_t capacity;

  __device__ __forceinline__ void operator()(ptrdiff_t i, int64_t position) const {
    if (i < capacity) out[i] = position;
  }
};

using PositionIterator = thrust::counting_iterator<int64_t>;
using BoundedOutput = thrust::tabulate_output_iterator<StoreWithinCapacity>;

// Launcher: selects changed positions among global positions [0, num_positions). With
// temp_storage == nullptr only sets temp_storage_bytes (CUB's two-phase protocol).
inline cudaError_t select_changed_positions(void* temp_storage, size_t& temp_storage_bytes,
                                            const uint32_t* chunk_tensor, const EncodeTensor* tensors,
                                            int64_t num_positions, int64_t* positions, int64_t capacity,
                                            int64_t* num_selected, cudaStream_t stream) {
  return cub::DeviceSelect::If(temp_storage, temp_storage_bytes, PositionIterator(0),
                               BoundedOutput(StoreWithinCapacity{positions, capacity}), num_selected,
                               num_positions, ChangedAtPosition{chunk_tensor, tensors}, stream);
}

// ---------------------------------------------------------------------------------------------
// Chunk table: chunk c belongs to the last tensor whose start is <= c * kChunkElements (empty
// tensors share their start with the next tensor and so never own a chunk).

__global__ void build_chunk_table_kernel(const uint64_t* starts, uint64_t num_tensors, uint32_t* chunk_tensor,
                                         uint64_t num_chunks) {
  for (uint64_t c = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; c < num_chunks;
       c += uint64_t{gridDim.x} * blockDim.x) {
    chunk_tensor[c] = static_cast<uint32_t>(last_not_greater(starts, num_tensors, c << kChunkShift));
  }
}

inline cudaError_t build_chunk_table(const uint64_t* starts, uint64_t num_tensors, uint32_t* chunk_tensor,
                                     uint64_t num_chunks, int sm_count, cudaStream_t stream) {
  if (num_chunks == 0) return cudaSuccess;
  constexpr unsigned kThreads = 256;
  build_chunk_table_kernel<<<grid_for(num_chunks, kThreads, sm_count), kThreads, 0, stream>>>(
      starts, num_tensors, chunk_tensor, num_chunks);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// Per-tensor offsets and value offsets

__global__ void tensor_offsets_kernel(const int64_t* positions, const uint64_t* starts, uint64_t num_tensors,
                                      const EncodeCounts* counts, int64_t capacity, uint64_t* offsets) {
  const int64_t selected = counts->num_selected;
  if (selected > capacity) return;  // overflowed: the host reruns the pipeline
  for (uint64_t t = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; t <= num_tensors;
       t += uint64_t{gridDim.x} * blockDim.x) {
    offsets[t] = t == num_tensors
                     ? static_cast<uint64_t>(selected)
                     : lower_bound(positions, static_cast<uint64_t>(selected), static_cast<int64_t>(starts[t]));
  }
}

template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    value_offsets_kernel(const EncodeTensor* tensors, const uint64_t* offsets, uint64_t num_tensors,
                         int64_t capacity, uint64_t* value_offsets, EncodeCounts* counts) {
  if (counts->num_selected > capacity) return;
  using Scan = cub::BlockScan<uint64_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  uint64_t running = 0;
  for (uint64_t base = 0; base < num_tensors; base += kThreads) {
    const uint64_t t = base + threadIdx.x;
    const uint64_t bytes = t < num_tensors ? (offsets[t + 1] - offsets[t]) * tensors[t].width : 0;
    uint64_t exclusive = 0, tile_total = 0;
    Scan(scan_storage).ExclusiveSum(bytes, exclusive, tile_total);
    if (t < num_tensors) value_offsets[t] = running + exclusive;
    running += tile_total;
    __syncthreads();  // scan_storage is reused by the next tile
  }
  if (threadIdx.x == 0) {
    value_offsets[num_tensors] = running;
    counts->value_bytes = running;
  }
}

inline cudaError_t compute_offsets(const int64_t* positions, const uint64_t* starts, const EncodeTensor* tensors,
                                   uint64_t num_tensors, EncodeCounts* counts, int64_t capacity, uint64_t* offsets,
                                   uint64_t* value_offsets, int sm_count, cudaStream_t stream) {
  constexpr unsigned kThreads = 256;
  tensor_offsets_kernel<<<grid_for(num_tensors + 1, kThreads, sm_count), kThreads, 0, stream>>>(
      positions, starts, num_tensors, counts, capacity, offsets);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  value_offsets_kernel<kThreads><<<1, kThreads, 0, stream>>>(tensors, offsets, num_tensors, capacity, value_offsets,
                                                             counts);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// Gather: global positions become local indices in place; new and base values are packed; the
// shadow catches up (after its old bits were read: each element is handled by one thread).

__global__ void gather_changed_kernel(int64_t* positions_to_indices, const uint32_t* chunk_tensor,
                                      const EncodeTensor* tensors, const uint64_t* offsets,
                                      const uint64_t* value_offsets, const EncodeCounts* counts, int64_t capacity,
                                      uint8_t* values, uint8_t* base_values) {
  const int64_t selected = counts->num_selected;
  if (selected > capacity) return;
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < static_cast<uint64_t>(selected);
       i += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t g = static_cast<uint64_t>(positions_to_indices[i]);
    const uint32_t t = chunk_tensor[g >> kChunkShift];
    const EncodeTensor& tensor = tensors[t];
    const uint64_t local = g - tensor.start;
    const uint8_t* current = tensor.current + local * tensor.width;
    uint8_t* shadow = tensor.shadow + local * tensor.width;
    const uint64_t packed = value_offsets[t] + (i - offsets[t]) * tensor.width;
    copy_element(current, values + packed, tensor.width);
    copy_element(shadow, base_values + packed, tensor.width);
    copy_element(current, shadow, tensor.width);
    positions_to_indices[i] = static_cast<int64_t>(local);
  }
}

inline cudaError_t gather_changed(int64_t* positions_to_indices, const uint32_t* chunk_tensor,
                                  const EncodeTensor* tensors, const uint64_t* offsets, const uint64_t* value_offsets,
                                  const EncodeCounts* counts, int64_t capacity, uint8_t* values,
                                  uint8_t* base_values, int sm_count, cudaStream_t stream) {
  if (capacity == 0) return cudaSuccess;
  constexpr unsigned kThreads = 256;
  gather_changed_kernel<<<grid_for(static_cast<uint64_t>(capacity), kThreads, sm_count), kThreads, 0, stream>>>(
      positions_to_indices, chunk_tensor, tensors, offsets, value_offsets, counts, capacity, values, base_values);
  return cudaGetLastError();
}

}  // namespace deltasync::cuda::detail
