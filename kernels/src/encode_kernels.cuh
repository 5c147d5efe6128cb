// Kernels shared by both select strategies of the encode pipeline (diff + compaction + gather +
// shadow update); the strategies themselves are in select_two_pass.cuh and
// select_single_pass.cuh, the host dispatch in encoder.cu.
//
// The tensor set is laid out in one virtual "global position" space: tensor t occupies global
// positions [start[t], start[t] + numel[t]) where every start is a multiple of kChunkElements. A
// chunk table (one uint32 tensor id per chunk) turns a chunk into its tensor with one load, and
// every chunk holds elements of exactly one tensor (the tail of a tensor's last chunk is padding).
// A chunk is compared by 128 threads, each owning one 32-bit word of the chunk's changed mask:
// 16-byte vector loads of current and shadow (granule q by thread q % 128, so a warp-wide load is
// one contiguous 512-byte span), the changed bits gathered in shared memory.
//
// After the select, both strategies share:
//   offsets        offsets[t] = changed elements before tensor t = the running count at the
//                  tensor's first chunk; value_offsets = exclusive scan of count[t] * width[t].
// Nothing writes the shadow until the number of changed elements is known to fit the output
// buffers; on overflow the host grows them and reruns the pipeline.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "element_copy.cuh"
#include "launch_config.cuh"

namespace deltasync::cuda::detail {

// 4096-element chunks (128 threads x 32 elements). The padding wasted per tensor (< 4096
// positions that are never loaded) is negligible, and the chunk table costs 4 bytes per 4096
// elements.
constexpr int kChunkShift = 12;
constexpr uint64_t kChunkElements = uint64_t{1} << kChunkShift;
constexpr int kChunkThreads = 128;
constexpr int kElementsPerThread = 32;  // one 32-bit word of the chunk's changed mask
static_assert(kChunkThreads * kElementsPerThread == kChunkElements);

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

// Bit k of the result: element k of the 16-byte granule differs (elements of kWidth bytes,
// little-endian, so element k sits in the low bytes first).
template <int kWidth>
__device__ __forceinline__ uint32_t granule_changed_mask(const uint4& a, const uint4& b) {
  const uint32_t d[4] = {a.x ^ b.x, a.y ^ b.y, a.z ^ b.z, a.w ^ b.w};
  uint32_t mask = 0;
#pragma unroll
  for (int word = 0; word < 4; ++word) {
    if constexpr (kWidth == 4) {
      mask |= uint32_t{d[word] != 0} << word;
    } else if constexpr (kWidth == 2) {
      mask |= (uint32_t{(d[word] & 0xFFFFu) != 0} | uint32_t{(d[word] >> 16) != 0} << 1) << (2 * word);
    } else {
#pragma unroll
      for (int byte = 0; byte < 4; ++byte) mask |= uint32_t{((d[word] >> (8 * byte)) & 0xFFu) != 0} << (4 * word + byte);
    }
  }
  return mask;
}

template <int kWidth>
__device__ __forceinline__ bool element_differs(const uint8_t* a, const uint8_t* b, uint32_t e) {
  if constexpr (kWidth == 1) return a[e] != b[e];
  if constexpr (kWidth == 2) return reinterpret_cast<const uint16_t*>(a)[e] != reinterpret_cast<const uint16_t*>(b)[e];
  return reinterpret_cast<const uint32_t*>(a)[e] != reinterpret_cast<const uint32_t*>(b)[e];
}

template <int kWidth>
__device__ __forceinline__ void store_element(uint8_t* dst, const uint8_t* src) {
  if constexpr (kWidth == 1) *dst = *src;
  if constexpr (kWidth == 2) *reinterpret_cast<uint16_t*>(dst) = *reinterpret_cast<const uint16_t*>(src);
  if constexpr (kWidth == 4) *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(src);
}

// A chunk as its 128 threads see it. width == 0: no chunk (past the end of the set).
struct ChunkView {
  const uint8_t* current;  // the chunk's first element
  uint8_t* shadow;
  uint64_t local0;  // its index in the tensor
  uint32_t n;       // elements in the chunk (the rest of the 4096 positions is padding)
  uint32_t width;
};

__device__ __forceinline__ ChunkView view_chunk(const EncodeTensor* tensors, const uint32_t* chunk_tensor,
                                                uint64_t num_chunks, uint64_t chunk) {
  ChunkView v{};
  if (chunk >= num_chunks) return v;
  const EncodeTensor t = tensors[chunk_tensor[chunk]];
  v.local0 = (chunk << kChunkShift) - t.start;
  const uint64_t left = t.numel - v.local0;
  v.n = left < kChunkElements ? static_cast<uint32_t>(left) : static_cast<uint32_t>(kChunkElements);
  v.width = t.width;
  v.current = t.current + v.local0 * t.width;
  v.shadow = t.shadow + v.local0 * t.width;
  return v;
}

// ---------------------------------------------------------------------------------------------
// The changed mask of one chunk: `mask_words` (128 words in shared memory; bit e of the array =
// element e of the chunk) for its first n elements; padding reads as unchanged. `thread` is the
// caller's index among the chunk's 128 threads (their warps must not hold other chunks' threads).

// Vector path (both chunk pointers 16-byte aligned). A thread owns 2 * kWidth granules per
// buffer, loaded kBatch at a time (2 * kBatch * 16 bytes in flight per thread).
template <int kWidth, int kBatch>
__device__ __forceinline__ void chunk_mask_vector(const ChunkView& v, uint32_t thread, uint32_t* mask_words) {
  constexpr uint32_t kGranuleElements = 16 / kWidth;
  constexpr int kGranulesPerThread = 2 * kWidth;
  static_assert(kGranulesPerThread * kGranuleElements * kChunkThreads == kChunkElements);
  constexpr int kLoads = kBatch < kGranulesPerThread ? kBatch : kGranulesPerThread;
  const auto* cur = reinterpret_cast<const uint4*>(v.current);
  const auto* sha = reinterpret_cast<const uint4*>(v.shadow);
  const uint32_t full_granules = v.n / kGranuleElements;
#pragma unroll
  for (int batch = 0; batch < kGranulesPerThread; batch += kLoads) {
    uint4 a[kLoads], b[kLoads];
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const uint32_t q = (batch + j) * kChunkThreads + thread;
      if (q < full_granules) {
        a[j] = cur[q];
        b[j] = sha[q];
      } else {
        a[j] = b[j] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int j = 0; j < kLoads; ++j) {
      const uint32_t q = (batch + j) * kChunkThreads + thread;
      uint32_t mask = granule_changed_mask<kWidth>(a[j], b[j]);
      if (q == full_granules) {  // the partial granule at the end of the tensor, element by element
        for (uint32_t e = q * kGranuleElements; e < v.n; ++e)
          mask |= uint32_t{element_differs<kWidth>(v.current, v.shadow, e)} << (e - q * kGranuleElements);
      }
      if constexpr (kWidth == 1) {
        reinterpret_cast<uint16_t*>(mask_words)[q] = static_cast<uint16_t>(mask);
      } else if constexpr (kWidth == 2) {
        reinterpret_cast<uint8_t*>(mask_words)[q] = static_cast<uint8_t>(mask);
      } else {
        // 4-bit masks: the even lane stores its own and its odd neighbour's (granule q + 1) as
        // one byte. Every lane takes part in the shuffle.
        const uint32_t neighbour = __shfl_down_sync(0xFFFFFFFFu, mask, 1);
        if ((q & 1) == 0) reinterpret_cast<uint8_t*>(mask_words)[q / 2] = static_cast<uint8_t>(mask | neighbour << 4);
      }
    }
  }
}

// Scalar path for tensors whose data is width-aligned but not 16-byte aligned (a view into a
// flat buffer): warp-wide element loads, one ballot per 32 elements.
template <int kWidth>
__device__ __forceinline__ void chunk_mask_scalar(const ChunkView& v, uint32_t thread, uint32_t* mask_words) {
  const uint32_t warp = thread / 32, lane = thread % 32;
#pragma unroll 4
  for (uint32_t k = 0; k < kElementsPerThread; ++k) {
    const uint32_t word = k * (kChunkThreads / 32) + warp;
    const uint32_t e = word * 32 + lane;
    const bool changed = e < v.n && element_differs<kWidth>(v.current, v.shadow, e);
    const uint32_t ballot = __ballot_sync(0xFFFFFFFFu, changed);
    if (lane == 0) mask_words[word] = ballot;
  }
}

template <int kBatch>
__device__ __forceinline__ void chunk_mask(const ChunkView& v, uint32_t thread, uint32_t* mask_words) {
  const bool vector = ((reinterpret_cast<uintptr_t>(v.current) | reinterpret_cast<uintptr_t>(v.shadow)) & 15) == 0;
  switch (v.width) {
    case 1:
      if (vector) chunk_mask_vector<1, kBatch>(v, thread, mask_words); else chunk_mask_scalar<1>(v, thread, mask_words);
      break;
    case 2:
      if (vector) chunk_mask_vector<2, kBatch>(v, thread, mask_words); else chunk_mask_scalar<2>(v, thread, mask_words);
      break;
    case 4:
      if (vector) chunk_mask_vector<4, kBatch>(v, thread, mask_words); else chunk_mask_scalar<4>(v, thread, mask_words);
      break;
    default: break;  // no chunk
  }
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
// Per-tensor offsets and value offsets (from the running count per chunk, chunk_prefix)

// offsets[t] = changed elements before tensor t = the running count at its first chunk (a tensor
// without chunks -- empty -- starts where the next one does, or at the end).
__global__ void tensor_offsets_kernel(const uint64_t* chunk_prefix, uint64_t num_chunks, const uint64_t* starts,
                                      uint64_t num_tensors, const EncodeCounts* counts, int64_t capacity,
                                      uint64_t* offsets) {
  const int64_t selected = counts->num_selected;
  if (selected > capacity) return;  // overflowed: the host reruns the pipeline
  for (uint64_t t = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; t <= num_tensors;
       t += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t chunk = t < num_tensors ? starts[t] >> kChunkShift : num_chunks;
    offsets[t] = chunk < num_chunks ? chunk_prefix[chunk] : static_cast<uint64_t>(selected);
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

// Needs counts->num_selected and chunk_prefix[0, num_chunks).
inline cudaError_t compute_offsets(const uint64_t* chunk_prefix, uint64_t num_chunks, const uint64_t* starts,
                                   const EncodeTensor* tensors, uint64_t num_tensors, EncodeCounts* counts,
                                   int64_t capacity, uint64_t* offsets, uint64_t* value_offsets, int sm_count,
                                   cudaStream_t stream) {
  constexpr unsigned kThreads = 256;
  tensor_offsets_kernel<<<grid_for(num_tensors + 1, kThreads, sm_count), kThreads, 0, stream>>>(
      chunk_prefix, num_chunks, starts, num_tensors, counts, capacity, offsets);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  value_offsets_kernel<kThreads><<<1, kThreads, 0, stream>>>(tensors, offsets, num_tensors, capacity, value_offsets,
                                                             counts);
  return cudaGetLastError();
}

}  // namespace deltasync::cuda::detail
