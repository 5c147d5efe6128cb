// Kernels of the GPU compact encoder, in launch order (host dispatch: compact_encoder.cu):
//   1. encode_blocks   one thread block per compact block, in phases separated by barriers:
//                      a. every thread of warps 1.. takes a contiguous run of changes: tokens
//                         (kept in the block's scratch), shared histograms, its raw-bit count;
//                      b. thread 0 quantizes the two tables (the CPU's exact integer rule),
//                         writes them and the encoder view of every symbol, and scans the
//                         raw-bit counts into bit offsets;
//                      c. the same threads write their changes' raw bits at their offsets (OR
//                         into zeroed 32-bit words: neighbouring runs share a word at a border);
//                      d. meanwhile four threads of warp 0, one per rANS lane, run the four chains
//                         in lockstep (the chains are independent; only their bytes interleave)
//                         and record per symbol how many bytes it emitted and which;
//                      e. every thread scans those counts over a contiguous run of symbols and
//                         places the bytes where the CPU's backwards writer puts them.
//   2. (CUB exclusive scan of the block sizes: payload offsets across all tensors)
//   3. write_index     one thread per block: its 32-byte record; a tensor's first block also
//                      writes the tensor's header (24 bytes, 32 with tiles: index version 2).
// (Before 1, the changes of banded tensors are put in coded order by compact_tile_kernels.cuh.)
//   4. gather_payload  one thread block per compact block: copies tables, rANS stream and raw
//                      bits from the scratch slot to their final place.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "compact_block_coder.cuh"

namespace deltasync::cuda::detail {

// One compact block, as planned on the host (pointers are device addresses).
struct CompactEncodeTask {
  const int64_t* positions;   // count ascending positions
  const uint8_t* new_bits;    // count * width bytes
  const uint8_t* base_bits;   // count * width bytes
  uint64_t scratch_offset;    // start of the block's scratch slot (a multiple of 16)
  uint64_t index_offset;      // start of its tensor's .cindex bytes in the index buffer
  uint64_t tensor_changed;    // changes in its tensor
  uint32_t count;
  uint32_t width;
  uint32_t block_in_tensor;
  uint32_t tensor_num_blocks;
  uint32_t tensor_first_block;  // global index of its tensor's block 0
  uint32_t block_elements;
  uint32_t index_header_bytes;  // 24 (index version 1) or 32 (version 2: + bands and stripes)
  uint32_t bands;
  uint32_t stripes;
};

// What encode_blocks leaves per block beside the scratch bytes.
struct CompactBlockSizes {
  uint32_t table_bytes;
  uint32_t rans_bytes;
  uint32_t bits_bytes;
  uint32_t rans_begin;  // offset of the rANS stream inside the scratch slot
};

inline constexpr unsigned kCompactEncodeThreads = 256;  // short per-thread runs in the parallel phases

// Scratch slot of a block of `count` changes (every region 16-byte aligned): tables; tokens
// (gap then value, one byte each); one 32-bit emit record per rANS symbol (2 count - 1); the
// rANS stream (16 bytes of states + <= 2 bytes per symbol); raw bits as 32-bit words
// (<= 61 + 29 bits per change).
struct CompactScratchLayout {
  uint64_t tokens, emit, rans, bits, total;
  __host__ __device__ static uint64_t align16(uint64_t v) { return (v + 15) / 16 * 16; }
  __host__ __device__ static CompactScratchLayout for_count(uint64_t count) {
    CompactScratchLayout l{};
    l.tokens = align16(compact_coder::kMaxTableBytes);
    l.emit = align16(l.tokens + 2 * count);
    l.rans = align16(l.emit + 4 * (2 * count));
    l.bits = align16(l.rans + 16 + 4 * count);
    l.total = align16(l.bits + 12 * count + 16);
    return l;
  }
};

namespace compact_encode {

using namespace compact_coder;

__device__ inline uint64_t gap_of(const int64_t* positions, uint32_t i) {
  return static_cast<uint64_t>(positions[i] - positions[i - 1] - 1);
}

__device__ inline uint32_t symbol_of(const CompactEncodeTask& t, uint32_t i) {
  const uint64_t at = uint64_t{i} * t.width;
  return value_symbol(load_bits(t.new_bits + at, t.width), load_bits(t.base_bits + at, t.width), t.width);
}

// ORs the n <= 64 low bits of v into the LSB-first bit stream `words` at bit `offset`.
__device__ inline void or_bits(uint32_t* words, uint64_t offset, uint64_t v, uint32_t n) {
  while (n > 0) {
    const uint32_t shift = static_cast<uint32_t>(offset & 31);
    const uint32_t take = (32 - shift) < n ? (32 - shift) : n;
    const uint32_t piece = static_cast<uint32_t>(low_bits(v, take));
    if (piece != 0) atomicOr(&words[offset >> 5], piece << shift);
    v = take >= 64 ? 0 : v >> take;
    offset += take;
    n -= take;
  }
}

// Exclusive scan of one value per thread (thread 0 serially: at most kCompactEncodeThreads
// values). Returns the total; `values` becomes the exclusive prefix.
template <typename T>
__device__ inline T exclusive_scan_serial(T* values, unsigned n) {
  T acc = 0;
  for (unsigned k = 0; k < n; ++k) {
    const T v = values[k];
    values[k] = acc;
    acc += v;
  }
  return acc;
}

__global__ void __launch_bounds__(kCompactEncodeThreads)
    encode_blocks(const CompactEncodeTask* tasks, uint8_t* scratch, CompactBlockSizes* sizes, uint64_t* block_bytes) {
  __shared__ uint32_t gap_hist[kGapTokens], value_hist[kMaxValueTokens];
  __shared__ uint32_t gap_freq[kGapTokens], gap_start[kGapTokens];
  __shared__ uint32_t value_freq[kMaxValueTokens], value_start[kMaxValueTokens];
  __shared__ EncSymbol enc[kGapTokens + kMaxValueTokens];  // gap symbols, then value symbols
  __shared__ uint64_t bit_base[kCompactEncodeThreads];
  __shared__ uint32_t emit_base[kCompactEncodeThreads];
  __shared__ uint64_t total_bits;
  __shared__ uint32_t total_emitted;
  __shared__ uint32_t final_state[4];
  const CompactEncodeTask task = tasks[blockIdx.x];
  const uint32_t count = task.count;
  const CompactScratchLayout layout = CompactScratchLayout::for_count(count);
  uint8_t* const slot = scratch + task.scratch_offset;
  uint8_t* const gap_tokens = slot + layout.tokens;
  uint8_t* const value_tokens = gap_tokens + count;
  uint32_t* const emit = reinterpret_cast<uint32_t*>(slot + layout.emit);
  uint8_t* const rans = slot + layout.rans;
  uint32_t* const bit_words = reinterpret_cast<uint32_t*>(slot + layout.bits);
  const unsigned T = blockDim.x;
  const unsigned tid = threadIdx.x;

  // a. Tokens, histograms, raw-bit counts over a contiguous run of changes per thread.
  for (uint32_t s = tid; s < kGapTokens; s += T) gap_hist[s] = 0;
  for (uint32_t s = tid; s < kMaxValueTokens; s += T) value_hist[s] = 0;
  __syncthreads();
  // Phases a and c run on the warps after the first (warp 0 runs the rANS chains in phase d,
  // concurrently with phase c); runs are per worker, the same in both phases.
  const unsigned workers = T - 32;
  const unsigned worker = tid - 32;  // wraps for warp 0, which has no run
  const uint32_t run = (count + workers - 1) / workers;
  const uint32_t run_begin = tid < 32 ? count : min(count, worker * run);
  const uint32_t run_end = tid < 32 ? count : min(count, run_begin + run);
  {
    uint64_t bits = 0;
    for (uint32_t i = run_begin; i < run_end; ++i) {
      if (i > 0) {
        const Token g = tokenize(gap_of(task.positions, i));
        gap_tokens[i] = static_cast<uint8_t>(g.token);
        atomicAdd(&gap_hist[g.token], 1u);
        bits += g.extra_bits;
      }
      // Value symbols are < 2^(8*width), so their tokens stay below value_token_limit(width) <= 128.
      const Token v = tokenize(symbol_of(task, i));
      value_tokens[i] = static_cast<uint8_t>(v.token);
      atomicAdd(&value_hist[v.token], 1u);
      bits += v.extra_bits;
    }
    if (tid >= 32) bit_base[worker] = bits;
  }
  __syncthreads();

  // b. Tables (gap, then value), encoder symbols, bit offsets.
  if (tid == 0) {
    const uint32_t gap_symbols = normalize(gap_hist, kGapTokens, gap_freq, gap_start);
    const uint32_t value_symbols = normalize(value_hist, value_token_limit(task.width), value_freq, value_start);
    uint32_t table_bytes = put_varint(slot, gap_symbols);
    for (uint32_t s = 0; s < gap_symbols; ++s) table_bytes += put_varint(slot + table_bytes, gap_freq[s]);
    table_bytes += put_varint(slot + table_bytes, value_symbols);
    for (uint32_t s = 0; s < value_symbols; ++s) table_bytes += put_varint(slot + table_bytes, value_freq[s]);
    // Only symbols with a nonzero frequency are ever coded.
    for (uint32_t s = 0; s < gap_symbols; ++s)
      if (gap_freq[s] != 0) enc[s] = enc_symbol(gap_start[s], gap_freq[s]);
    for (uint32_t s = 0; s < value_symbols; ++s)
      if (value_freq[s] != 0) enc[kGapTokens + s] = enc_symbol(value_start[s], value_freq[s]);
    total_bits = exclusive_scan_serial(bit_base, workers);
    sizes[blockIdx.x].table_bytes = table_bytes;
  }
  __syncthreads();

  // c. Raw bits in decode order (change 0's value bits, then per change its gap's and value's).
  const uint64_t words = (total_bits + 31) / 32;
  for (uint64_t w = tid; w < words; w += T) bit_words[w] = 0;
  __syncthreads();
  if (tid >= 32) {
    uint64_t offset = bit_base[worker];
    for (uint32_t i = run_begin; i < run_end; ++i) {
      if (i > 0) {
        const uint32_t n = token_extra_bits(gap_tokens[i]);
        or_bits(bit_words, offset, gap_of(task.positions, i), n);
        offset += n;
      }
      const uint32_t n = token_extra_bits(value_tokens[i]);
      if (n != 0) {
        or_bits(bit_words, offset, symbol_of(task, i), n);
        offset += n;
      }
    }
  }

  // d. The four rANS chains. The CPU codes changes in reverse order, per change the value token
  // (lane 1 even / 3 odd) then the gap token (lane 0 even / 2 odd), each symbol emitting its
  // bytes below the previous ones; symbol p of that sequence is change count-1-p/2, value
  // when p is even. Each lane walks its own changes in that order and records, per symbol,
  // the number of bytes (0..2) and the bytes, in the CPU's renormalization arithmetic.
  if (tid < 4) {
    const bool is_value = tid & 1;
    const uint32_t parity = tid >> 1;
    const uint8_t* tokens = is_value ? value_tokens : gap_tokens;
    const EncSymbol* table = is_value ? enc + kGapTokens : enc;
    const int64_t last = static_cast<int64_t>(count) - 1;
    const int64_t stop = is_value ? 0 : 1;  // change 0 has no gap
    int64_t i = (static_cast<uint32_t>(last) & 1) == parity ? last : last - 1;
    uint32_t x = kRansLow;
    // The next symbol's token and table entry are loaded one step ahead, off the state chain.
    EncSymbol e = table[i >= stop ? tokens[i] : 0];
    uint32_t next_token = i - 2 >= stop ? tokens[i - 2] : 0;
    for (; i >= stop; i -= 2) {
      const EncSymbol current = e;
      e = table[next_token];
      next_token = i - 4 >= stop ? tokens[i - 4] : 0;
      const uint32_t k = static_cast<uint32_t>(x >= current.x_max) + static_cast<uint32_t>(x >= current.x_max2);
      emit[2 * static_cast<uint64_t>(last - i) + (is_value ? 0 : 1)] = k | (x & 0xFFu) << 8 | ((x >> 8) & 0xFFu) << 16;
      x >>= 8 * k;
      const uint32_t q = __umulhi(x, current.rcp_freq) >> (current.rcp_shift - 32);
      x += current.bias + q * current.cmpl_freq;
    }
    final_state[tid] = x;
  }
  __syncthreads();

  // e. Place the emitted bytes. The stream is the four final states (lane 0 first), then the
  // emitted bytes in reverse emission order; symbol p's bytes end where the bytes of symbols
  // p+1.. begin, i.e. emitted-after-p bytes from the start of the byte area.
  const uint32_t symbols = 2 * count - 1;
  const uint32_t srun = (symbols + T - 1) / T;
  const uint32_t s_begin = min(symbols, tid * srun), s_end = min(symbols, s_begin + srun);
  {
    uint32_t emitted = 0;
    for (uint32_t p = s_begin; p < s_end; ++p) emitted += emit[p] & 3u;
    emit_base[tid] = emitted;
  }
  __syncthreads();
  if (tid == 0) total_emitted = exclusive_scan_serial(emit_base, T);
  __syncthreads();
  {
    uint32_t before = emit_base[tid];  // bytes emitted by symbols 0 .. p-1
    uint8_t* const area = rans + 16;
    for (uint32_t p = s_begin; p < s_end; ++p) {
      const uint32_t r = emit[p];
      const uint32_t k = r & 3u;
      const uint32_t at = total_emitted - before - k;  // first byte of symbol p in the stream
      if (k == 2) {
        area[at] = static_cast<uint8_t>(r >> 16);
        area[at + 1] = static_cast<uint8_t>(r >> 8);
      } else if (k == 1) {
        area[at] = static_cast<uint8_t>(r >> 8);
      }
      before += k;
    }
  }
  if (tid == 0) {
    for (int lane = 0; lane < 4; ++lane) store_u32(rans + 4 * lane, final_state[lane]);
    CompactBlockSizes& s = sizes[blockIdx.x];
    s.rans_bytes = 16 + total_emitted;
    s.bits_bytes = static_cast<uint32_t>((total_bits + 7) / 8);
    s.rans_begin = static_cast<uint32_t>(layout.rans);
    block_bytes[blockIdx.x] = uint64_t{s.table_bytes} + s.rans_bytes + s.bits_bytes;
  }
}

__global__ void write_index(const CompactEncodeTask* tasks, const CompactBlockSizes* sizes,
                            const uint64_t* payload_offsets, uint32_t num_blocks, uint8_t* index) {
  const uint64_t b = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (b >= num_blocks) return;
  const CompactEncodeTask task = tasks[b];
  const CompactBlockSizes s = sizes[b];
  const uint64_t tensor_payload_start = payload_offsets[task.tensor_first_block];
  uint8_t* record = index + task.index_offset + task.index_header_bytes + uint64_t{task.block_in_tensor} * kRecordBytes;
  store_u64(record, static_cast<uint64_t>(task.positions[0]));
  store_u64(record + 8, payload_offsets[b] - tensor_payload_start);
  store_u32(record + 16, task.count);
  store_u32(record + 20, s.table_bytes);
  store_u32(record + 24, s.rans_bytes);
  store_u32(record + 28, s.bits_bytes);
  if (task.block_in_tensor == 0) {
    uint8_t* header = index + task.index_offset;
    store_u64(header, task.tensor_changed);
    store_u64(header + 8, payload_offsets[b + task.tensor_num_blocks] - tensor_payload_start);
    store_u32(header + 16, task.block_elements);
    store_u32(header + 20, task.tensor_num_blocks);
    if (task.index_header_bytes > kIndexHeaderBytes) {
      store_u32(header + 24, task.bands);
      store_u32(header + 28, task.stripes);
    }
  }
}

__device__ inline void copy_bytes(uint8_t* dst, const uint8_t* src, uint64_t n) {
  for (uint64_t k = threadIdx.x; k < n; k += blockDim.x) dst[k] = src[k];
}

__global__ void gather_payload(const CompactEncodeTask* tasks, const CompactBlockSizes* sizes,
                               const uint8_t* scratch, const uint64_t* payload_offsets, uint8_t* payload) {
  const CompactEncodeTask task = tasks[blockIdx.x];
  const CompactBlockSizes s = sizes[blockIdx.x];
  const CompactScratchLayout layout = CompactScratchLayout::for_count(task.count);
  const uint8_t* slot = scratch + task.scratch_offset;
  uint8_t* out = payload + payload_offsets[blockIdx.x];
  copy_bytes(out, slot, s.table_bytes);
  copy_bytes(out + s.table_bytes, slot + s.rans_begin, s.rans_bytes);
  copy_bytes(out + s.table_bytes + s.rans_bytes, slot + layout.bits, s.bits_bytes);
}

}  // namespace compact_encode

// Launchers: all on `stream`, no synchronization.
inline cudaError_t launch_compact_encode_blocks(const CompactEncodeTask* tasks, uint32_t num_blocks, uint8_t* scratch,
                                                CompactBlockSizes* sizes, uint64_t* block_bytes, cudaStream_t stream) {
  if (num_blocks == 0) return cudaSuccess;
  compact_encode::encode_blocks<<<num_blocks, kCompactEncodeThreads, 0, stream>>>(tasks, scratch, sizes, block_bytes);
  return cudaGetLastError();
}

inline cudaError_t launch_compact_write_index(const CompactEncodeTask* tasks, const CompactBlockSizes* sizes,
                                              const uint64_t* payload_offsets, uint32_t num_blocks, uint8_t* index,
                                              cudaStream_t stream) {
  if (num_blocks == 0) return cudaSuccess;
  constexpr unsigned kThreads = 128;
  compact_encode::write_index<<<(num_blocks + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
      tasks, sizes, payload_offsets, num_blocks, index);
  return cudaGetLastError();
}

inline cudaError_t launch_compact_gather_payload(const CompactEncodeTask* tasks, const CompactBlockSizes* sizes,
                                                 uint32_t num_blocks, const uint8_t* scratch,
                                                 const uint64_t* payload_offsets, uint8_t* payload,
                                                 cudaStream_t stream) {
  if (num_blocks == 0) return cudaSuccess;
  compact_encode::gather_payload<<<num_blocks, 256, 0, stream>>>(tasks, sizes, scratch, payload_offsets, payload);
  return cudaGetLastError();
}

}  // namespace deltasync::cuda::detail
