// Kernels and launchers of the encode pipeline (diff + compaction + gather + shadow update).
//
// The tensor set is laid out in one virtual "global position" space: tensor t occupies global
// positions [start[t], start[t] + numel[t]) where every start is a multiple of kChunkElements. A
// chunk table (one uint32 tensor id per chunk) turns a chunk into its tensor with one load, and
// every chunk holds elements of exactly one tensor (the tail of a tensor's last chunk is padding).
//
// Pipeline (all on one stream, one host synchronization at the end):
//   1. select      tiles of two chunks, single pass with CUB's decoupled look-back:
//                  16-byte vector loads of current and shadow, a 4096-bit changed mask per chunk
//                  in shared memory, a block scan of per-thread popcounts whose prefix comes from
//                  the preceding tiles, then each thread writes its changed elements' local
//                  index, new bits and base bits (re-read from L1/L2, just loaded) at their final
//                  place. Persistent blocks load the next tile while they scan, look back and
//                  write the current one. Writes past the output capacity are dropped; the count
//                  stays exact.
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
#include <cuda_pipeline_primitives.h>

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

template <int kWidth>
__device__ __forceinline__ void store_element(uint8_t* dst, const uint8_t* src) {
  if constexpr (kWidth == 1) *dst = *src;
  if constexpr (kWidth == 2) *reinterpret_cast<uint16_t*>(dst) = *reinterpret_cast<const uint16_t*>(src);
  if constexpr (kWidth == 4) *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(src);
}

// ---------------------------------------------------------------------------------------------
// 1. Select

struct SelectParams {
  const uint32_t* chunk_tensor;
  const EncodeTensor* tensors;
  SelectTileState tile_state;
  unsigned int* next_tile;  // tile dispenser, zeroed by the init kernel
  uint64_t num_chunks;
  uint64_t* chunk_prefix;  // [num_chunks]: changed elements in all chunks before chunk c
  int64_t* indices;        // [capacity]: local index of the i-th changed element of the set
  uint8_t* values;         // [capacity * value_stride]: its new bits, at i * value_stride
  uint8_t* base_values;    // [capacity * value_stride]: the shadow's bits
  uint32_t value_stride;   // the widest width of the set (= every width when they are equal)
  int64_t capacity;
  EncodeCounts* counts;    // num_selected written with the last tile
};

// A chunk as its 128 threads see it. width == 0: no chunk (past the end of the set).
struct ChunkView {
  const uint8_t* current;  // the chunk's first element
  const uint8_t* shadow;
  uint64_t local0;  // its index in the tensor
  uint32_t n;       // elements in the chunk (the rest of the 4096 positions is padding)
  uint32_t width;
  bool vector;  // both pointers 16-byte aligned: the vector path
};

__device__ __forceinline__ ChunkView view_chunk(const SelectParams& p, uint64_t chunk) {
  ChunkView v{};
  if (chunk >= p.num_chunks) return v;
  const EncodeTensor t = p.tensors[p.chunk_tensor[chunk]];
  v.local0 = (chunk << kChunkShift) - t.start;
  const uint64_t left = t.numel - v.local0;
  v.n = left < kChunkElements ? static_cast<uint32_t>(left) : static_cast<uint32_t>(kChunkElements);
  v.width = t.width;
  v.current = t.current + v.local0 * t.width;
  v.shadow = t.shadow + v.local0 * t.width;
  v.vector = ((reinterpret_cast<uintptr_t>(v.current) | reinterpret_cast<uintptr_t>(v.shadow)) & 15) == 0;
  return v;
}

// Granule q of a chunk (16 bytes, 16/kWidth elements) is loaded by thread q % 128, so every
// warp-wide load is one contiguous 512-byte span; a thread owns 2 * kWidth granules per buffer.
// The first kAhead of them are loaded one tile ahead (see select_changed_kernel), all of an 8-
// or 16-bit chunk's share and half of a 32-bit one's, by asynchronous copies into shared memory
// (registers would not hold them across the look-back without spilling). Each thread reads back
// only the slots it filled itself, so a wait on its own copies is all the ordering needed.
constexpr int kAhead = 4;
struct AheadLoads {
  uint4 (*slots)[2][kTileThreads];  // [kAhead][current, shadow][thread of the block]
};

template <int kWidth, int kFirst, int kCount>
__device__ __forceinline__ void load_granules(const ChunkView& v, uint32_t thread, uint4* a, uint4* b) {
  constexpr uint32_t kGranuleElements = 16 / kWidth;
  const auto* cur = reinterpret_cast<const uint4*>(v.current);
  const auto* sha = reinterpret_cast<const uint4*>(v.shadow);
  const uint32_t full_granules = v.n / kGranuleElements;
#pragma unroll
  for (int j = 0; j < kCount; ++j) {
    const uint32_t q = (kFirst + j) * kChunkThreads + thread;
    if (q < full_granules) {
      a[j] = cur[q];
      b[j] = sha[q];
    } else {
      a[j] = b[j] = make_uint4(0, 0, 0, 0);
    }
  }
}

template <int kWidth>
__device__ __forceinline__ void copy_ahead(const ChunkView& v, uint32_t thread, const AheadLoads& ahead) {
  constexpr int kGranulesPerThread = 2 * kWidth;
  constexpr int kLoaded = kGranulesPerThread < kAhead ? kGranulesPerThread : kAhead;
  constexpr uint32_t kGranuleElements = 16 / kWidth;
  const auto* cur = reinterpret_cast<const uint4*>(v.current);
  const auto* sha = reinterpret_cast<const uint4*>(v.shadow);
  const uint32_t full_granules = v.n / kGranuleElements;
#pragma unroll
  for (int j = 0; j < kLoaded; ++j) {
    const uint32_t q = j * kChunkThreads + thread;
    uint4& current_slot = ahead.slots[j][0][threadIdx.x];
    uint4& shadow_slot = ahead.slots[j][1][threadIdx.x];
    if (q < full_granules) {
      __pipeline_memcpy_async(&current_slot, cur + q, sizeof(uint4));
      __pipeline_memcpy_async(&shadow_slot, sha + q, sizeof(uint4));
    } else {
      current_slot = shadow_slot = make_uint4(0, 0, 0, 0);
    }
  }
}

__device__ __forceinline__ void load_ahead(const ChunkView& v, uint32_t thread, const AheadLoads& ahead) {
  if (v.vector) {  // the scalar path loads when it runs
    switch (v.width) {
      case 0: break;
      case 1: copy_ahead<1>(v, thread, ahead); break;
      case 2: copy_ahead<2>(v, thread, ahead); break;
      default: copy_ahead<4>(v, thread, ahead); break;
    }
  }
  __pipeline_commit();
}

// Changed bits of granules kFirst.. of this thread into the chunk's mask (`mask_words`, 128
// words in shared memory; bit e of the array = element e of the chunk).
template <int kWidth, int kFirst, int kCount, typename Granules>
__device__ __forceinline__ void mask_granules(const ChunkView& v, uint32_t thread, Granules granule,
                                              uint32_t* mask_words) {
  constexpr uint32_t kGranuleElements = 16 / kWidth;
  const uint32_t full_granules = v.n / kGranuleElements;
#pragma unroll
  for (int j = 0; j < kCount; ++j) {
    const uint32_t q = (kFirst + j) * kChunkThreads + thread;
    uint32_t mask = granule_changed_mask<kWidth>(granule(j, 0), granule(j, 1));
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

template <int kWidth>
__device__ __forceinline__ void chunk_mask_vector(const ChunkView& v, uint32_t thread, const AheadLoads& ahead,
                                                  uint32_t* mask_words) {
  constexpr int kGranulesPerThread = 2 * kWidth;
  constexpr int kLoaded = kGranulesPerThread < kAhead ? kGranulesPerThread : kAhead;
  __pipeline_wait_prior(0);  // this thread's copies of the chunk have landed
  mask_granules<kWidth, 0, kLoaded>(
      v, thread, [&](int j, int buffer) { return ahead.slots[j][buffer][threadIdx.x]; }, mask_words);
  if constexpr (kGranulesPerThread > kLoaded) {  // 32-bit elements: the second half now
    uint4 a[kGranulesPerThread - kLoaded], b[kGranulesPerThread - kLoaded];
    load_granules<kWidth, kLoaded, kGranulesPerThread - kLoaded>(v, thread, a, b);
    mask_granules<kWidth, kLoaded, kGranulesPerThread - kLoaded>(
        v, thread, [&](int j, int buffer) { return buffer == 0 ? a[j] : b[j]; }, mask_words);
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

template <int kWidth>
__device__ __forceinline__ void chunk_mask(const ChunkView& v, uint32_t thread, const AheadLoads& ahead,
                                           uint32_t* mask_words) {
  if (v.vector) chunk_mask_vector<kWidth>(v, thread, ahead, mask_words);
  else chunk_mask_scalar<kWidth>(v, thread, mask_words);
}

// Writes the changed elements of this thread's 32-element word: local index, new bits and base
// bits (re-read: the lines were just loaded, so these hit L1 or L2), from output slot
// first_output on. Slots past the capacity are dropped (the host grows and reruns).
template <int kWidth>
__device__ __forceinline__ void write_changed(const SelectParams& p, const ChunkView& v, uint32_t thread,
                                              uint32_t word, uint64_t first_output) {
  uint64_t i = first_output;
  while (word != 0) {
    const uint32_t bit = __ffs(word) - 1;
    word &= word - 1;
    if (i >= static_cast<uint64_t>(p.capacity)) return;
    const uint32_t e = thread * kElementsPerThread + bit;
    p.indices[i] = static_cast<int64_t>(v.local0 + e);
    store_element<kWidth>(p.values + i * p.value_stride, v.current + e * kWidth);
    store_element<kWidth>(p.base_values + i * p.value_stride, v.shadow + e * kWidth);
    ++i;
  }
}

// Persistent blocks of 256 threads; a tile is two chunks (128 threads each; no warp straddles
// two chunks), handed out in increasing order by an atomic dispenser. Each block takes its next
// tile and issues that tile's loads *before* it scans, looks back and writes the current one, so
// loads stay in flight while the block waits. Deadlock-free whatever the residency: a tile only
// waits for lower tiles, and every handed-out tile belongs to a running block that processes its
// tiles in increasing order. 4 blocks per multiprocessor (<= 64 registers, 36 KiB of shared
// memory each).
__global__ void __launch_bounds__(kTileThreads, 4) select_changed_kernel(SelectParams p) {
  using BlockScan = cub::BlockScan<unsigned long long, kTileThreads>;
  using LookBack = cub::TilePrefixCallbackOp<unsigned long long, ::cuda::std::plus<>, SelectTileState>;
  __shared__ uint32_t mask_words[kTileThreads];  // kChunksPerTile masks of 128 words
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ typename LookBack::TempStorage look_back_storage;
  __shared__ unsigned int dispensed_tile;
  __shared__ uint4 ahead_slots[kAhead][2][kTileThreads];  // 32 KiB
  const AheadLoads ahead{ahead_slots};

  const uint64_t num_tiles = (p.num_chunks + kChunksPerTile - 1) / kChunksPerTile;
  const uint32_t part = threadIdx.x / kChunkThreads;    // which chunk of the tile
  const uint32_t thread = threadIdx.x % kChunkThreads;  // thread within that chunk
  uint32_t* chunk_mask_words = mask_words + part * kChunkThreads;

  if (threadIdx.x == 0) dispensed_tile = atomicAdd(p.next_tile, 1u);
  __syncthreads();
  uint64_t tile = dispensed_tile;
  __syncthreads();  // every thread has read it before thread 0 takes the next one
  ChunkView view = view_chunk(p, tile * kChunksPerTile + part);
  load_ahead(view, thread, ahead);
  while (tile < num_tiles) {
    // The next tile is taken now; its number is read after the barrier below.
    if (threadIdx.x == 0) dispensed_tile = atomicAdd(p.next_tile, 1u);
    switch (view.width) {
      case 0: break;
      case 1: chunk_mask<1>(view, thread, ahead, chunk_mask_words); break;
      case 2: chunk_mask<2>(view, thread, ahead, chunk_mask_words); break;
      default: chunk_mask<4>(view, thread, ahead, chunk_mask_words); break;
    }
    __syncthreads();
    const uint32_t word = view.width != 0 ? mask_words[threadIdx.x] : 0;
    const uint64_t next_tile = dispensed_tile;
    // The next tile's loads fly while this one scans, looks back and writes. (dispensed_tile
    // and mask_words are rewritten only after the scan's barriers, which every thread passes
    // after these reads.)
    const ChunkView chunk_view = view;
    view = view_chunk(p, next_tile * kChunksPerTile + part);
    load_ahead(view, thread, ahead);

    const unsigned long long count = __popc(word);
    unsigned long long first_output = 0;
    if (tile == 0) {
      unsigned long long tile_total = 0;
      BlockScan(scan_storage).ExclusiveSum(count, first_output, tile_total);
      if (threadIdx.x == 0) p.tile_state.SetInclusive(0, tile_total);
    } else {
      LookBack look_back(p.tile_state, look_back_storage, ::cuda::std::plus<>{}, static_cast<int>(tile));
      BlockScan(scan_storage).ExclusiveSum(count, first_output, look_back);
    }
    if (chunk_view.width != 0 && thread == 0) p.chunk_prefix[tile * kChunksPerTile + part] = first_output;
    if (tile + 1 == num_tiles && threadIdx.x == kTileThreads - 1)
      p.counts->num_selected = static_cast<int64_t>(first_output + count);
    if (word != 0) {
      switch (chunk_view.width) {
        case 1: write_changed<1>(p, chunk_view, thread, word, first_output); break;
        case 2: write_changed<2>(p, chunk_view, thread, word, first_output); break;
        default: write_changed<4>(p, chunk_view, thread, word, first_output); break;
      }
    }
    tile = next_tile;
  }
}

__global__ void init_select_kernel(SelectTileState tile_state, int num_tiles, unsigned int* next_tile) {
  tile_state.InitializeStatus(num_tiles);
  if (blockIdx.x == 0 && threadIdx.x == 0) *next_tile = 0;
}

inline int select_tiles(uint64_t num_chunks) {
  return static_cast<int>((num_chunks + kChunksPerTile - 1) / kChunksPerTile);
}

// Temporary storage of the select's look-back for num_chunks chunks.
inline cudaError_t select_tile_state_bytes(uint64_t num_chunks, size_t& bytes) {
  return SelectTileState::AllocationSize(select_tiles(num_chunks), bytes);
}

// Blocks of the select that fit on the device at once (its grid: more would only wait).
inline cudaError_t select_resident_blocks(int sm_count, int& blocks) {
  int per_sm = 0;
  const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, select_changed_kernel, kTileThreads, 0);
  blocks = (per_sm > 0 ? per_sm : 1) * (sm_count > 0 ? sm_count : 1);
  return err;
}

// Launcher: selects the changed elements of every chunk (num_chunks >= 1, < 2^31) and writes them
// as described in SelectParams; `tile_storage` holds select_tile_state_bytes(num_chunks) bytes;
// `resident_blocks` from select_resident_blocks.
inline cudaError_t select_changed(SelectParams p, void* tile_storage, size_t tile_storage_bytes, int resident_blocks,
                                  cudaStream_t stream) {
  const int num_tiles = select_tiles(p.num_chunks);
  cudaError_t err = p.tile_state.Init(num_tiles, tile_storage, tile_storage_bytes);
  if (err != cudaSuccess) return err;
  constexpr unsigned kInitThreads = 256;
  init_select_kernel<<<(num_tiles + kInitThreads - 1) / kInitThreads, kInitThreads, 0, stream>>>(
      p.tile_state, num_tiles, p.next_tile);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const int blocks = num_tiles < resident_blocks ? num_tiles : resident_blocks;
  select_changed_kernel<<<blocks, kTileThreads, 0, stream>>>(p);
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
