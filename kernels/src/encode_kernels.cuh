// Kernels and launchers of the encode pipeline (diff + compaction + gather + shadow update).
//
// The tensor set is laid out in one virtual "global position" space: tensor t occupies global
// positions [start[t], start[t] + numel[t]) where every start is a multiple of kChunkElements. A
// chunk table (one uint32 tensor id per chunk) turns a chunk into its tensor with one load, and
// every chunk holds elements of exactly one tensor (the tail of a tensor's last chunk is padding).
//
// Pipeline (all on one stream, one host synchronization at the end):
//   1. select      one thread block per two chunks, single pass with CUB's decoupled look-back:
//                  16-byte vector loads of current and shadow, a 4096-bit changed mask in shared
//                  memory, a block scan of per-thread popcounts whose prefix comes from the
//                  preceding chunks, then each thread writes its changed elements' local index,
//                  new bits and base bits (re-read from L1/L2, just loaded) at their final place.
//                  Writes past the output capacity are dropped; the count stays exact.
//   2. offsets     offsets[t] = the select's running count at the tensor's first chunk;
//                  value_offsets = exclusive scan of count[t] * width[t].
//   3. finish      O(changed): shadow <- new bits at the changed positions, and, for a set that
//                  mixes element widths, the packing of the values per tensor (the select wrote
//                  them at a uniform stride of the widest width, into scratch).
// Steps 2-3 do nothing when step 1 overflowed its capacity; the host then grows the buffers and
// reruns the pipeline. That is only correct because step 1 never modifies the shadow.
//
// Why this shape: the first GPU measurement (H200, 2^28 bf16, 1% changed) of a cub::DeviceSelect
// with a per-element predicate ran at 0.18 of device-copy bandwidth, bound by per-element work.
// Here each thread handles 32 elements with 16-byte loads, so the pass is bound by the bytes it
// reads (2 * N * width), and nothing but the changed elements is touched a second time.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <cub/agent/single_pass_scan_operators.cuh>
#include <cub/block/block_scan.cuh>
#include <cuda/std/functional>

#include "element_copy.cuh"
#include "launch_config.cuh"

namespace deltasync::cuda::detail {

// 4096-element chunks, each handled by 128 threads x 32 elements; a select tile (one block, one
// look-back) is two chunks. The padding wasted per tensor (< 4096 positions that are never
// loaded) is negligible, and the chunk table costs 4 bytes per 4096 elements.
constexpr int kChunkShift = 12;
constexpr uint64_t kChunkElements = uint64_t{1} << kChunkShift;
constexpr int kChunkThreads = 128;
constexpr int kElementsPerThread = 32;  // one 32-bit word of the chunk's changed mask
static_assert(kChunkThreads * kElementsPerThread == kChunkElements);
constexpr int kChunksPerTile = 2;  // halves the look-backs and descriptor loads per byte
constexpr int kTileThreads = kChunkThreads * kChunksPerTile;

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

// Decoupled look-back state of the select: one status word + running count per chunk.
using SelectTileState = cub::ScanTileState<unsigned long long>;

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

// Fills the chunk's 4096-bit changed mask (`mask_words`, 128 words in shared memory; bit e of
// the array = element e of the chunk) for the first `n` elements (the rest read as unchanged).
// Vector path: granule q (16 bytes, 16/kWidth elements) is loaded by thread q % 128, so every
// warp-wide load is one contiguous 512-byte span. Needs both chunk pointers 16-byte aligned.
template <int kWidth>
__device__ __forceinline__ void chunk_mask_vector(const uint8_t* current, const uint8_t* shadow, uint32_t n,
                                                  uint32_t thread, uint32_t* mask_words) {
  constexpr int kGranuleElements = 16 / kWidth;
  constexpr int kGranulesPerThread = int(kChunkElements) / kGranuleElements / kChunkThreads;  // 2, 4, 8
  // Loads are issued in batches of up to 4 granules per buffer (128 bytes in flight per thread):
  // enough to cover DRAM latency at full occupancy, few enough registers (<= 64 per thread) for
  // 8 blocks per multiprocessor, which the look-back waits of one block need to hide behind.
  constexpr int kBatch = kGranulesPerThread < 4 ? kGranulesPerThread : 4;
  const auto* cur = reinterpret_cast<const uint4*>(current);
  const auto* sha = reinterpret_cast<const uint4*>(shadow);
  const uint32_t full_granules = n / kGranuleElements;
#pragma unroll
  for (int batch = 0; batch < kGranulesPerThread; batch += kBatch) {
    uint4 a[kBatch], b[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const uint32_t q = (batch + j) * kChunkThreads + thread;
      if (q < full_granules) {
        a[j] = cur[q];
        b[j] = sha[q];
      } else {
        a[j] = b[j] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const uint32_t q = (batch + j) * kChunkThreads + thread;
      uint32_t mask = granule_changed_mask<kWidth>(a[j], b[j]);
      if (q == full_granules) {  // the partial granule at the end of the tensor, element by element
        for (uint32_t e = q * kGranuleElements; e < n; ++e)
          mask |= uint32_t{element_differs<kWidth>(current, shadow, e)} << (e - q * kGranuleElements);
      }
      if constexpr (kWidth == 1) {
        reinterpret_cast<uint16_t*>(mask_words)[q] = static_cast<uint16_t>(mask);
      } else if constexpr (kWidth == 2) {
        reinterpret_cast<uint8_t*>(mask_words)[q] = static_cast<uint8_t>(mask);
      } else {
        // 4-bit masks: the even lane stores its own and its odd neighbour's (granule q + 1) as
        // one byte. Every lane takes part in the shuffle.
        const uint32_t neighbour = __shfl_down_sync(0xFFFFFFFFu, mask, 1);
        if ((q & 1) == 0)
          reinterpret_cast<uint8_t*>(mask_words)[q / 2] = static_cast<uint8_t>(mask | neighbour << 4);
      }
    }
  }
}

// Scalar path for tensors whose data is width-aligned but not 16-byte aligned (a view into a
// flat buffer): warp-wide element loads, one ballot per 32 elements.
template <int kWidth>
__device__ __forceinline__ void chunk_mask_scalar(const uint8_t* current, const uint8_t* shadow, uint32_t n,
                                                  uint32_t thread, uint32_t* mask_words) {
  const uint32_t warp = thread / 32, lane = thread % 32;
#pragma unroll 4
  for (uint32_t k = 0; k < kElementsPerThread; ++k) {
    const uint32_t word = k * (kChunkThreads / 32) + warp;
    const uint32_t e = word * 32 + lane;
    const bool changed = e < n && element_differs<kWidth>(current, shadow, e);
    const uint32_t ballot = __ballot_sync(0xFFFFFFFFu, changed);
    if (lane == 0) mask_words[word] = ballot;
  }
}

template <int kWidth>
__device__ __forceinline__ void chunk_mask(const uint8_t* current, const uint8_t* shadow, uint32_t n,
                                           uint32_t thread, uint32_t* mask_words) {
  const bool vector_aligned = ((reinterpret_cast<uintptr_t>(current) | reinterpret_cast<uintptr_t>(shadow)) & 15) == 0;
  if (vector_aligned) chunk_mask_vector<kWidth>(current, shadow, n, thread, mask_words);
  else chunk_mask_scalar<kWidth>(current, shadow, n, thread, mask_words);
}

template <int kWidth>
__device__ __forceinline__ void store_element(uint8_t* dst, const uint8_t* src) {
  if constexpr (kWidth == 1) *dst = *src;
  if constexpr (kWidth == 2) *reinterpret_cast<uint16_t*>(dst) = *reinterpret_cast<const uint16_t*>(src);
  if constexpr (kWidth == 4) *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(src);
}

// ---------------------------------------------------------------------------------------------
// 1. Select (one block per chunk)

struct SelectParams {
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

__global__ void init_select_tile_state_kernel(SelectTileState tile_state, int num_tiles) {
  tile_state.InitializeStatus(num_tiles);
}

template <int kWidth>
__device__ __forceinline__ void write_changed(const SelectParams& p, uint32_t word, uint32_t thread,
                                              uint64_t first_output, uint64_t local0, const uint8_t* current,
                                              const uint8_t* shadow) {
  uint64_t i = first_output;
  while (word != 0) {
    const uint32_t bit = __ffs(word) - 1;
    word &= word - 1;
    if (i >= static_cast<uint64_t>(p.capacity)) return;  // overflow: dropped, the host reruns
    const uint32_t e = thread * kElementsPerThread + bit;
    p.indices[i] = static_cast<int64_t>(local0 + e);
    store_element<kWidth>(p.values + i * p.value_stride, current + e * kWidth);
    store_element<kWidth>(p.base_values + i * p.value_stride, shadow + e * kWidth);
    ++i;
  }
}

// The chunk's first element as a local index of its tensor.
__device__ __forceinline__ uint64_t chunk_local0(const EncodeTensor& tensor, uint64_t chunk) {
  return (chunk << kChunkShift) - tensor.start;
}

// The chunk's changed mask; positions past the tensor's end (padding) read as unchanged.
template <int kWidth>
__device__ __forceinline__ void select_chunk(const EncodeTensor& tensor, uint64_t chunk, uint32_t thread,
                                                 uint32_t* chunk_mask_words) {
  const uint64_t local0 = chunk_local0(tensor, chunk);
  const uint64_t left = tensor.numel - local0;
  const uint32_t n = left < kChunkElements ? static_cast<uint32_t>(left) : static_cast<uint32_t>(kChunkElements);
  chunk_mask<kWidth>(tensor.current + local0 * kWidth, tensor.shadow + local0 * kWidth, n, thread, chunk_mask_words);
}

template <int kWidth>
__device__ __forceinline__ void write_chunk(const SelectParams& p, const EncodeTensor& tensor, uint64_t chunk,
                                            uint32_t thread, uint32_t word, uint64_t first_output) {
  const uint64_t local0 = chunk_local0(tensor, chunk);
  write_changed<kWidth>(p, word, thread, first_output, local0, tensor.current + local0 * kWidth,
                        tensor.shadow + local0 * kWidth);
}

// One tile = kChunksPerTile consecutive chunks (a trailing tile may have fewer); each chunk is
// handled by its own kChunkThreads threads, whose warps never straddle two chunks. 4 blocks of
// 256 threads per multiprocessor (<= 64 registers): while one block waits in its look-back or
// writes its outputs, the others keep loads in flight.
__global__ void __launch_bounds__(kTileThreads, 4) select_changed_kernel(SelectParams p) {
  using BlockScan = cub::BlockScan<unsigned long long, kTileThreads>;
  using LookBack = cub::TilePrefixCallbackOp<unsigned long long, ::cuda::std::plus<>, SelectTileState>;
  __shared__ uint32_t mask_words[kTileThreads];  // kChunksPerTile masks of 128 words
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ typename LookBack::TempStorage look_back_storage;

  const int tile = static_cast<int>(blockIdx.x);
  const uint32_t part = threadIdx.x / kChunkThreads;   // which chunk of the tile
  const uint32_t thread = threadIdx.x % kChunkThreads;  // thread within that chunk
  const uint64_t chunk = uint64_t{blockIdx.x} * kChunksPerTile + part;
  const bool has_chunk = chunk < p.num_chunks;
  uint32_t* chunk_mask_words = mask_words + part * kChunkThreads;
  EncodeTensor tensor{};
  if (has_chunk) {
    tensor = p.tensors[p.chunk_tensor[chunk]];
    switch (tensor.width) {
      case 1: select_chunk<1>(tensor, chunk, thread, chunk_mask_words); break;
      case 2: select_chunk<2>(tensor, chunk, thread, chunk_mask_words); break;
      default: select_chunk<4>(tensor, chunk, thread, chunk_mask_words); break;
    }
  }
  __syncthreads();
  const uint32_t word = has_chunk ? mask_words[threadIdx.x] : 0;
  const unsigned long long count = __popc(word);
  unsigned long long first_output = 0;
  if (tile == 0) {
    unsigned long long tile_total = 0;
    BlockScan(scan_storage).ExclusiveSum(count, first_output, tile_total);
    if (threadIdx.x == 0) p.tile_state.SetInclusive(0, tile_total);
  } else {
    LookBack look_back(p.tile_state, look_back_storage, ::cuda::std::plus<>{}, tile);
    BlockScan(scan_storage).ExclusiveSum(count, first_output, look_back);
  }
  if (has_chunk && thread == 0) p.chunk_prefix[chunk] = first_output;
  if (blockIdx.x + 1 == gridDim.x && threadIdx.x == kTileThreads - 1)
    p.counts->num_selected = static_cast<int64_t>(first_output + count);
  if (word == 0) return;
  switch (tensor.width) {
    case 1: write_chunk<1>(p, tensor, chunk, thread, word, first_output); break;
    case 2: write_chunk<2>(p, tensor, chunk, thread, word, first_output); break;
    default: write_chunk<4>(p, tensor, chunk, thread, word, first_output); break;
  }
}

inline int select_tiles(uint64_t num_chunks) {
  return static_cast<int>((num_chunks + kChunksPerTile - 1) / kChunksPerTile);
}

// Temporary storage of the select's look-back for num_chunks chunks.
inline cudaError_t select_tile_state_bytes(uint64_t num_chunks, size_t& bytes) {
  return SelectTileState::AllocationSize(select_tiles(num_chunks), bytes);
}

// Launcher: selects the changed elements of every chunk (num_chunks >= 1, < 2^31) and writes them
// as described in SelectParams; `tile_storage` holds select_tile_state_bytes(num_chunks) bytes.
inline cudaError_t select_changed(SelectParams p, void* tile_storage, size_t tile_storage_bytes,
                                  cudaStream_t stream) {
  const int num_tiles = select_tiles(p.num_chunks);
  cudaError_t err = p.tile_state.Init(num_tiles, tile_storage, tile_storage_bytes);
  if (err != cudaSuccess) return err;
  constexpr unsigned kInitThreads = 256;
  init_select_tile_state_kernel<<<(num_tiles + kInitThreads - 1) / kInitThreads, kInitThreads, 0, stream>>>(
      p.tile_state, num_tiles);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  select_changed_kernel<<<num_tiles, kTileThreads, 0, stream>>>(p);
  return cudaGetLastError();
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
// 2. Per-tensor offsets and value offsets

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

// ---------------------------------------------------------------------------------------------
// 3. Finish: the shadow catches up at the changed positions (its old bits are already in
// base_values), and a mixed-width set has its values packed per tensor.

struct FinishParams {
  const EncodeTensor* tensors;
  uint64_t num_tensors;
  const uint64_t* offsets;
  const uint64_t* value_offsets;
  const EncodeCounts* counts;
  int64_t capacity;
  const int64_t* indices;
  const uint8_t* strided_values;       // as the select wrote them: i * value_stride
  const uint8_t* strided_base_values;
  uint32_t value_stride;
  uint8_t* packed_values;              // nullptr when every width equals value_stride (already packed)
  uint8_t* packed_base_values;
};

__global__ void finish_encode_kernel(FinishParams p) {
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

inline cudaError_t finish_encode(const FinishParams& p, int sm_count, cudaStream_t stream) {
  if (p.capacity == 0) return cudaSuccess;
  constexpr unsigned kThreads = 256;
  finish_encode_kernel<<<grid_for(static_cast<uint64_t>(p.capacity), kThreads, sm_count), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace deltasync::cuda::detail
