// Kernels of the GPU compact decoder, in launch order (host dispatch: compact_decoder.cu; the
// block index has already been validated on the host):
//   1. decode_blocks       one warp per compact block: lane 0 reads the two frequency tables,
//                          (compact_version 2: the warp decodes, one rANS lane per thread,
//                          see decode_lanes; version 1 as follows)
//                          the warp fills the 4096-slot lookup tables in shared memory and
//                          stages the block's streams there (when they fit), lane 0 decodes
//                          the rANS stream and the raw bits serially (positions checked
//                          against the tensor as they are formed), then the warp gathers the base
//                          bits at the decoded positions and applies the value symbols. A defect
//                          is recorded in the block's fault slot and the lowest bad block index
//                          is kept with atomicMin; a bad block never reads the base.
//   2. check_block_order   one thread per block: a tensor's block must start after the previous
//                          block's last position (the blocks were decoded independently), and
//                          a tiled tensor's block must end in the tile it starts in.
//   (then, for banded tensors, the reorder into flat order of compact_tile_kernels.cuh)
// The checks and their order are those of host/codec/compact_codec_block.cpp (decode_block), so
// the host can rebuild the CPU twin's message from a fault code and two numbers.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <initializer_list>

#include "codec/compact_format.hpp"  // compact_version
#include "codec/compact_tiles.hpp"
#include "compact_block_coder.cuh"
#include "compact_decode_status.cuh"

namespace deltasync::cuda::detail {

struct CompactDecodeTask {
  const uint8_t* payload;  // the block's payload (table_bytes + rans_bytes + bits_bytes)
  const uint8_t* base;     // the whole base tensor, numel elements of width bytes
  int64_t* positions;      // outputs: count positions, new bits, base bits
  uint8_t* new_bits;
  uint8_t* base_bits;
  uint64_t first_position;  // < numel (checked with the index)
  uint64_t numel;
  uint32_t count;  // >= 1 (checked with the index)
  uint32_t table_bytes;
  uint32_t rans_bytes;
  uint32_t bits_bytes;
  uint32_t width;
  uint32_t block_in_tensor;
  uint32_t version;  // compact_version: 1 (four lanes, byte stream) or 2 (32 lanes, word stream)
  compact::TileGeometry tiles;  // the tensor's tiles (positions are coded positions when it has bands)
};

enum CompactFault : uint32_t {
  kFaultNone = 0,
  kFaultTableTruncated,        // "frequency table truncated"
  kFaultTableOverlong,         // "frequency table has an overlong number"
  kFaultTooManySymbols,        // "KIND table has A symbols (at most B)"
  kFaultTableEmpty,            // "KIND table is empty"
  kFaultTableExceedsScale,     // "KIND table frequencies exceed the scale"
  kFaultTableShortOfScale,     // "KIND table frequencies do not sum to the scale"
  kFaultTablesTrailing,        // "frequency tables have trailing bytes"
  kFaultRansTruncated,         // "rANS stream truncated"
  kFaultRansInitialState,      // "rANS stream has an invalid initial state"
  kFaultRawTruncated,          // "raw bit stream truncated"
  kFaultGapOutside,            // "gap after position A leads outside the tensor (B elements)"
  kFaultRansTrailing,          // "rANS stream has trailing bytes or a bad final state"
  kFaultRawTrailing,           // "raw bit stream has trailing bytes"
};

struct CompactBlockFault {
  uint32_t code;
  uint32_t value_table;  // for table faults: 0 gap table, 1 value table
  uint64_t a;
  uint64_t b;
};


namespace compact_decode {

using namespace compact_coder;

// The CPU decoder's chunk for compact_version 1 (host/codec/compact_codec_block.cpp,
// kByteChunk): it decodes the rANS tokens of kDecodeChunk changes, checks the stream for
// truncation, then reads their raw bits. The GPU follows the same structure so that a payload
// with several defects is refused with the same (first found) one; change both together.
inline constexpr uint32_t kDecodeChunk = 16;

// A thread's reader of one block's streams (version 1: lane 0's; version 2: every lane holds
// one, at the same positions). Like the CPU's zero-padded stream copies, bytes past the
// end of either stream read as zero; overruns are detected from the positions afterwards.
struct Reader {
  const uint8_t* rans;
  uint32_t rans_pos, rans_end;
  const uint8_t* bits;
  uint32_t bits_bytes;

  __host__ __device__ uint32_t rans_byte(uint32_t at) const { return at < rans_end ? rans[at] : 0u; }
  // One rANS symbol on a lane; slot entry = symbol | (freq - 1) << 8 | (slot - start) << 20.
  // Before renormalization y is in [2^11, 2^31) on any input (start <= slot < start + freq), so
  // 0, 1 or 2 bytes come in, as in the CPU's branch-free step.
  __host__ __device__ uint32_t get_symbol(uint32_t& x, const uint32_t* slots) {
    const uint32_t e = slots[x & (kScale - 1)];
    const uint32_t y = (((e >> 8) & 0xFFFu) + 1) * (x >> kScaleBits) + (e >> 20);
    if (y >= kRansLow) {
      x = y;
    } else if (y >= (kRansLow >> 8)) {
      x = (y << 8) | rans_byte(rans_pos);
      rans_pos += 1;
    } else {
      x = (y << 16) | rans_byte(rans_pos) << 8 | rans_byte(rans_pos + 1);
      rans_pos += 2;
    }
    return e & 0xFFu;
  }
  // n <= 64 raw bits at bit offset `at`, LSB first.
  __host__ __device__ uint64_t raw_at(uint64_t at, uint32_t n) const {
    uint64_t v = 0;
    for (uint32_t got = 0; got < n;) {
      const uint64_t bit = at + got;
      const uint32_t shift = static_cast<uint32_t>(bit & 7);
      const uint32_t take = (8 - shift) < (n - got) ? (8 - shift) : (n - got);
      const uint64_t byte_index = bit >> 3;
      const uint32_t byte = byte_index < bits_bytes ? bits[byte_index] : 0u;
      v |= static_cast<uint64_t>((byte >> shift) & ((1u << take) - 1u)) << got;
      got += take;
    }
    return v;
  }
};

// One LEB128 varint of at most five bytes at p[at, end); sets the fault when it runs off the end
// or is longer.
__host__ __device__ inline uint32_t get_varint(const uint8_t* p, uint32_t& at, uint32_t end, uint32_t& fault) {
  uint32_t v = 0;
  for (uint32_t shift = 0; shift < 35; shift += 7) {
    if (at == end) {
      fault = kFaultTableTruncated;
      return 0;
    }
    const uint8_t b = p[at++];
    v |= static_cast<uint32_t>(b & 0x7F) << shift;
    if (!(b & 0x80)) return v;
  }
  fault = kFaultTableOverlong;
  return 0;
}

// Reads one frequency table (lane 0): num_symbols, then the frequencies; fills freq/start.
// Returns num_symbols, or sets the fault.
__host__ __device__ inline uint32_t read_table(const uint8_t* p, uint32_t& at, uint32_t end, uint32_t limit, bool required,
                                      uint16_t* freq, uint16_t* start, CompactBlockFault& f) {
  const uint32_t num_symbols = get_varint(p, at, end, f.code);
  if (f.code != kFaultNone) return 0;
  if (num_symbols > limit) {
    f = {kFaultTooManySymbols, f.value_table, num_symbols, limit};
    return 0;
  }
  if (num_symbols == 0) {
    if (required) f.code = kFaultTableEmpty;
    return 0;
  }
  uint32_t acc = 0;
  for (uint32_t s = 0; s < num_symbols; ++s) {
    const uint32_t fr = get_varint(p, at, end, f.code);
    if (f.code != kFaultNone) return 0;
    if (fr > kScale - acc) {
      f.code = kFaultTableExceedsScale;
      return 0;
    }
    freq[s] = static_cast<uint16_t>(fr);
    start[s] = static_cast<uint16_t>(acc);
    acc += fr;
  }
  if (acc != kScale) {
    f.code = kFaultTableShortOfScale;
    return 0;
  }
  return num_symbols;
}

// The whole warp fills a table's 4096 slot entries (the frequencies sum to exactly 4096).
__host__ __device__ inline void fill_slots(uint32_t num_symbols, const uint16_t* freq, const uint16_t* start,
                                           uint32_t* slots, uint32_t first, uint32_t stride) {
  for (uint32_t s = first; s < num_symbols; s += stride)
    for (uint32_t k = 0; k < freq[s]; ++k) slots[start[s] + k] = s | (uint32_t{freq[s]} - 1) << 8 | k << 20;
}

// Lane 0: both frequency tables, then the size checks the CPU makes before decoding symbols.
// Returns the fault code (also in `fault`).
__host__ __device__ inline uint32_t read_tables(const CompactDecodeTask& task, uint16_t* gap_freq, uint16_t* gap_start,
                                                uint16_t* value_freq, uint16_t* value_start, uint32_t& num_gap_symbols,
                                                uint32_t& num_value_symbols, CompactBlockFault& fault) {
  uint32_t at = 0;
  num_gap_symbols =
      read_table(task.payload, at, task.table_bytes, kGapTokens, task.count > 1, gap_freq, gap_start, fault);
  if (fault.code == kFaultNone) {
    fault.value_table = 1;
    num_value_symbols = read_table(task.payload, at, task.table_bytes, value_token_limit(task.width), true, value_freq,
                                   value_start, fault);
  }
  if (fault.code == kFaultNone && at != task.table_bytes) fault.code = kFaultTablesTrailing;
  const uint32_t state_bytes = task.version == compact::kFormatVersion2 ? 4 * compact::kWordLanes : 16;
  if (fault.code == kFaultNone && task.rans_bytes < state_bytes) fault.code = kFaultRansTruncated;
  return fault.code;
}

// Lane 0: the block's changes, serially. `streams` holds the rANS stream then the raw bits;
// writes positions and the value symbols (parked in new_bits). Returns the fault code.
__host__ __device__ inline uint32_t decode_serial(const CompactDecodeTask& task, const uint8_t* streams,
                                                  const uint32_t* gap_slots, const uint32_t* value_slots,
                                                  uint8_t* chunk_gap, uint8_t* chunk_value, CompactBlockFault& fault) {
  const uint32_t W = task.width;
  // Serial decode (lane 0): positions, and the value symbols parked in new_bits. The checks
  // come in the CPU decoder's order: change 0 (value token, its raw bits), then per chunk of
  // kDecodeChunk changes the tokens (then rANS truncation), the raw bits change by change (a
  // gap leading outside the tensor is reported as a raw-bit truncation when the bits read so
  // far overran the stream), then raw-bit truncation; finally the trailing-bytes checks.
  {
    Reader r{streams, 16, task.rans_bytes, streams + task.rans_bytes, task.bits_bytes};
    const uint64_t bits_total = uint64_t{task.bits_bytes} * 8;
    uint32_t f = kFaultNone;
    uint32_t x0 = load_bits(streams, 4), x1 = load_bits(streams + 4, 4), x2 = load_bits(streams + 8, 4),
             x3 = load_bits(streams + 12, 4);
    for (const uint32_t x : {x0, x1, x2, x3})
      if (x < kRansLow || x >= (kRansLow << 8)) f = kFaultRansInitialState;
    uint64_t position = task.first_position;
    uint64_t bit_at = 0;
    if (f == kFaultNone) {
      const uint32_t vt = r.get_symbol(x1, value_slots);
      const uint32_t n = token_extra_bits(vt);
      const uint64_t symbol = token_base(vt) + r.raw_at(bit_at, n);
      bit_at += n;
      if (bit_at > bits_total) {
        f = kFaultRawTruncated;
      } else {
        task.positions[0] = static_cast<int64_t>(position);
        store_bits(task.new_bits, static_cast<uint32_t>(symbol), W);
      }
    }
    // Chunks start at odd changes: change begin + k uses lanes 2/3 (gap/value) for even k.
    // 64-bit counters: a block index may claim up to 2^32 - 1 changes, and a 32-bit `begin`
    // stepping past that would wrap and never end.
    for (uint64_t begin = 1; f == kFaultNone && begin < task.count; begin += kDecodeChunk) {
      const auto n = static_cast<uint32_t>(task.count - begin < kDecodeChunk ? task.count - begin : kDecodeChunk);
      uint32_t k = 0;
      for (; k + 1 < n; k += 2) {
        chunk_gap[k] = static_cast<uint8_t>(r.get_symbol(x2, gap_slots));
        chunk_value[k] = static_cast<uint8_t>(r.get_symbol(x3, value_slots));
        chunk_gap[k + 1] = static_cast<uint8_t>(r.get_symbol(x0, gap_slots));
        chunk_value[k + 1] = static_cast<uint8_t>(r.get_symbol(x1, value_slots));
      }
      if (k < n) {
        chunk_gap[k] = static_cast<uint8_t>(r.get_symbol(x2, gap_slots));
        chunk_value[k] = static_cast<uint8_t>(r.get_symbol(x3, value_slots));
      }
      if (r.rans_pos > r.rans_end) {
        f = kFaultRansTruncated;
        break;
      }
      for (k = 0; k < n; ++k) {
        const uint32_t gt = chunk_gap[k], vt = chunk_value[k];
        const uint32_t gap_n = token_extra_bits(gt), value_n = token_extra_bits(vt);
        const uint64_t gap = token_base(gt) + r.raw_at(bit_at, gap_n);
        const uint64_t value_raw = r.raw_at(bit_at + gap_n, value_n);
        bit_at += gap_n + value_n;
        // position + 1 + gap < numel, written so that nothing can overflow.
        if (gap >= task.numel - position - 1) {
          if (bit_at > bits_total) {
            f = kFaultRawTruncated;
          } else {
            f = kFaultGapOutside;
            fault.a = position;
            fault.b = task.numel;
          }
          break;
        }
        position += gap + 1;
        task.positions[begin + k] = static_cast<int64_t>(position);
        store_bits(task.new_bits + uint64_t{begin + k} * W, static_cast<uint32_t>(token_base(vt) + value_raw), W);
      }
      if (f == kFaultNone && bit_at > bits_total) f = kFaultRawTruncated;
    }
    if (f == kFaultNone &&
        (r.rans_pos != r.rans_end || x0 != kRansLow || x1 != kRansLow || x2 != kRansLow || x3 != kRansLow))
      f = kFaultRansTrailing;
    if (f == kFaultNone) {
      // Everything consumed but fewer than 8 zero padding bits.
      const uint64_t left = bits_total - bit_at;
      if (left >= 8 || (left > 0 && r.raw_at(bit_at, static_cast<uint32_t>(left)) != 0)) f = kFaultRawTrailing;
    }
    fault.code = f;
    return f;
  }
}

#ifdef __CUDACC__
// compact_version 2, by the whole warp: thread l runs rANS lane l, so a group of 32 changes
// (change begin + l in lane l) takes one step per round. The shared word stream is split by a
// ballot: the lanes that refill take consecutive words in lane order, as in the CPU's
// word_round. Raw-bit offsets are a warp scan of the changes' bit counts; positions a
// saturating scan of gap + 1, capped at numel - position so that the first change leaving the
// tensor is found exactly (and nothing overflows). Checks in the CPU's order (WordLanes in
// compact_codec_block.cpp): per group the tokens, then rANS truncation, then change by change
// a gap leading outside (a raw-bit truncation if the bits read so far overran), then raw-bit
// truncation; finally the trailing checks. Every thread returns the same fault.
__device__ inline uint32_t word_step(uint32_t& x, bool active, const uint32_t* slots, Reader& r, uint32_t lower) {
  uint32_t symbol = 0;
  uint32_t y = x;
  if (active) {
    const uint32_t e = slots[x & (kScale - 1)];
    symbol = e & 0xFFu;
    y = (((e >> 8) & 0xFFFu) + 1) * (x >> kScaleBits) + (e >> 20);
  }
  const bool refill = active && y < compact::kWordRansLow;
  const uint32_t refills = __ballot_sync(0xFFFFFFFFu, refill);
  if (refill) {
    const uint32_t at = r.rans_pos + 2 * static_cast<uint32_t>(__popc(refills & lower));
    y = (y << 16) | r.rans_byte(at) | r.rans_byte(at + 1) << 8;
  }
  r.rans_pos += 2 * static_cast<uint32_t>(__popc(refills));
  x = y;
  return symbol;
}

template <class T>
__device__ inline T warp_inclusive_sum(T v, uint32_t lane) {
  for (uint32_t d = 1; d < 32; d <<= 1) {
    const T other = __shfl_up_sync(0xFFFFFFFFu, v, d);
    if (lane >= d) v += other;
  }
  return v;
}

__device__ inline uint32_t decode_lanes(const CompactDecodeTask& task, const uint8_t* streams,
                                        const uint32_t* gap_slots, const uint32_t* value_slots,
                                        CompactBlockFault& fault) {
  constexpr unsigned kAll = 0xFFFFFFFFu;
  const uint32_t W = task.width;
  const uint32_t lane = threadIdx.x;
  const uint32_t lower = (1u << lane) - 1u;
  Reader r{streams, 4 * compact::kWordLanes, task.rans_bytes, streams + task.rans_bytes, task.bits_bytes};
  const uint64_t bits_total = uint64_t{task.bits_bytes} * 8;
  uint32_t x = load_bits(streams + 4 * lane, 4);
  fault.code = kFaultNone;
  if (__any_sync(kAll, x < compact::kWordRansLow || x >= (compact::kWordRansLow << 16)))
    return fault.code = kFaultRansInitialState;
  uint64_t position = task.first_position;  // the last decoded change's (uniform)
  uint64_t bit_at = 0;                      // uniform
  for (uint64_t begin = 0; begin < task.count; begin += compact::kWordLanes) {  // 64-bit: see decode_serial
    const uint64_t i = begin + lane;
    const bool live = i < task.count;
    const bool has_gap = live && i != 0;
    const uint32_t gt = word_step(x, has_gap, gap_slots, r, lower);
    const uint32_t vt = word_step(x, live, value_slots, r, lower);
    if (r.rans_pos > r.rans_end) return fault.code = kFaultRansTruncated;
    const uint32_t gap_n = has_gap ? token_extra_bits(gt) : 0, value_n = live ? token_extra_bits(vt) : 0;
    const uint64_t bits_after = bit_at + warp_inclusive_sum<uint64_t>(gap_n + value_n, lane);  // this change's end
    const uint64_t my_bit = bits_after - gap_n - value_n;
    const uint64_t gap = token_base(gt) + r.raw_at(my_bit, gap_n);
    const uint64_t value_raw = r.raw_at(my_bit + gap_n, value_n);
    // Steps to this change's position, saturated at cap (= leaving the tensor).
    const uint64_t cap = task.numel - position;  // >= 1: position < numel
    uint64_t reach = has_gap ? (gap >= cap - 1 ? cap : gap + 1) : 0;
    for (uint32_t d = 1; d < 32; d <<= 1) {
      const uint64_t other = __shfl_up_sync(kAll, reach, d);
      if (lane >= d) reach = other >= cap - reach ? cap : reach + other;
    }
    const uint32_t outside = __ballot_sync(kAll, has_gap && reach == cap);
    if (outside != 0) {
      const uint32_t first = static_cast<uint32_t>(__ffs(outside)) - 1;
      const uint64_t before = __shfl_sync(kAll, reach, first == 0 ? 0 : first - 1);
      const uint64_t bits_then = __shfl_sync(kAll, bits_after, first);
      if (bits_then > bits_total) return fault.code = kFaultRawTruncated;
      fault.a = position + (first == 0 ? 0 : before);
      fault.b = task.numel;
      return fault.code = kFaultGapOutside;
    }
    if (live) {
      task.positions[i] = static_cast<int64_t>(position + reach);
      store_bits(task.new_bits + i * W, static_cast<uint32_t>(token_base(vt) + value_raw), W);
    }
    position += __shfl_sync(kAll, reach, 31);
    bit_at = __shfl_sync(kAll, bits_after, 31);
    if (bit_at > bits_total) return fault.code = kFaultRawTruncated;
  }
  if (r.rans_pos != r.rans_end || __any_sync(kAll, x != compact::kWordRansLow)) return fault.code = kFaultRansTrailing;
  const uint64_t left = bits_total - bit_at;
  if (left >= 8 || (left > 0 && r.raw_at(bit_at, static_cast<uint32_t>(left)) != 0)) return fault.code = kFaultRawTrailing;
  return fault.code;
}
#endif  // __CUDACC__

inline constexpr unsigned kDecodeThreads = 32;
// Largest rANS + raw-bit area staged in shared memory (beside ~34 KB of tables; less where the
// device has less room, see launch_compact_decode); a block with more reads its streams from
// global memory instead.
inline constexpr uint32_t kMaxStagedBytes = 160 * 1024;

// The kernels and their launcher need nvcc; the block logic above is plain host/device code
// (a host test checks it against the CPU decoder without a GPU).
#ifdef __CUDACC__
__global__ void __launch_bounds__(kDecodeThreads)
    decode_blocks(const CompactDecodeTask* tasks, CompactBlockFault* faults, CompactDecodeStatus* status,
                  uint32_t staged_capacity) {
  extern __shared__ uint8_t staged[];
  __shared__ uint32_t gap_slots[kScale], value_slots[kScale];
  __shared__ uint16_t gap_freq[kGapTokens], gap_start[kGapTokens];
  __shared__ uint16_t value_freq[kMaxValueTokens], value_start[kMaxValueTokens];
  __shared__ uint32_t num_gap_symbols, num_value_symbols, block_fault;
  __shared__ uint8_t chunk_gap[kDecodeChunk], chunk_value[kDecodeChunk];
  const CompactDecodeTask task = tasks[blockIdx.x];
  const uint32_t W = task.width;
  CompactBlockFault fault{kFaultNone, 0, 0, 0};

  // Tables (lane 0), then the slot lookups and the staged streams (whole warp).
  if (threadIdx.x == 0) {
    block_fault = read_tables(task, gap_freq, gap_start, value_freq, value_start, num_gap_symbols, num_value_symbols,
                              fault);
  }
  __syncwarp();
  if (block_fault != kFaultNone) {
    if (threadIdx.x == 0) {
      faults[blockIdx.x] = fault;
      atomicMin(&status->first_bad_block, blockIdx.x);
    }
    return;
  }
  fill_slots(num_gap_symbols, gap_freq, gap_start, gap_slots, threadIdx.x, kDecodeThreads);
  fill_slots(num_value_symbols, value_freq, value_start, value_slots, threadIdx.x, kDecodeThreads);
  const uint8_t* streams = task.payload + task.table_bytes;  // rANS stream, then raw bits
  const uint64_t stream_bytes = uint64_t{task.rans_bytes} + task.bits_bytes;
  if (stream_bytes <= staged_capacity) {
    for (uint32_t k = threadIdx.x; k < stream_bytes; k += kDecodeThreads) staged[k] = streams[k];
    streams = staged;
  }
  __syncwarp();

  if (task.version == compact::kFormatVersion2) {
    const uint32_t f = decode_lanes(task, streams, gap_slots, value_slots, fault);  // the same on every thread
    if (threadIdx.x == 0) {
      block_fault = f;
      if (f != kFaultNone) {
        faults[blockIdx.x] = fault;
        atomicMin(&status->first_bad_block, blockIdx.x);
      }
    }
  } else if (threadIdx.x == 0) {
    block_fault = decode_serial(task, streams, gap_slots, value_slots, chunk_gap, chunk_value, fault);
    if (block_fault != kFaultNone) {
      faults[blockIdx.x] = fault;
      atomicMin(&status->first_bad_block, blockIdx.x);
    }
  }
  __syncwarp();
  if (block_fault != kFaultNone) return;  // positions unchecked: the base is not read

  // Gather the base bits at the (validated) positions and apply the value symbols.
  for (uint32_t j = threadIdx.x; j < task.count; j += kDecodeThreads) {
    const uint64_t at = uint64_t{j} * W;
    const uint32_t old_bits = load_bits(task.base + static_cast<uint64_t>(task.positions[j]) * W, W);
    const uint32_t symbol = load_bits(task.new_bits + at, W);
    store_bits(task.base_bits + at, old_bits, W);
    store_bits(task.new_bits + at, apply_value_symbol(symbol, old_bits, W), W);
  }
}

// Runs only after a clean block decode: a faulted block's positions were never written (and the
// host reports the decode fault first anyway).
__global__ void check_block_order(const CompactDecodeTask* tasks, uint32_t num_blocks, CompactDecodeStatus* status) {
  const uint64_t b = uint64_t{blockIdx.x} * blockDim.x + threadIdx.x;
  if (b >= num_blocks || status->first_bad_block != kNoBadBlock) return;
  const CompactDecodeTask task = tasks[b];
  if (task.tiles.tiles() > 1 &&
      task.tiles.tile_of(static_cast<uint64_t>(task.positions[0])) != task.tiles.tile_of(static_cast<uint64_t>(task.positions[task.count - 1])))
    atomicMin(&status->first_crossing_block, static_cast<uint32_t>(b));
  if (task.block_in_tensor == 0) return;
  // Block b - 1 belongs to the same tensor and its outputs sit right before this block's.
  if (task.positions[0] <= task.positions[-1]) atomicMin(&status->first_unordered_block, static_cast<uint32_t>(b));
}

#endif  // __CUDACC__

}  // namespace compact_decode

#ifdef __CUDACC__
// Launchers: all on `stream`, no synchronization. `status` must hold kNoBadBlock in every field.
// `largest_streams`: the most rANS + raw-bit bytes of any block (staged in shared memory up to
// kMaxStagedBytes).
inline cudaError_t launch_compact_decode(const CompactDecodeTask* tasks, uint32_t num_blocks, uint64_t largest_streams,
                                         CompactBlockFault* faults, CompactDecodeStatus* status, cudaStream_t stream) {
  if (num_blocks == 0) return cudaSuccess;
  // The staging area the device leaves beside the kernel's own shared memory: an A100 allows a
  // block 163 KiB in all (an H100 227), less than the tables plus kMaxStagedBytes. The kernel's
  // limit is set to that whole room, the same value from every caller (a limit sized per
  // decode could be lowered by another thread's decode between this one's setting and launch).
  int device = 0, optin = 0;
  cudaFuncAttributes kernel{};
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&kernel, compact_decode::decode_blocks);
  if (err != cudaSuccess) return err;
  const uint64_t room = static_cast<uint64_t>(optin) > kernel.sharedSizeBytes ? static_cast<uint64_t>(optin) - kernel.sharedSizeBytes : 0;
  const uint64_t most = room < compact_decode::kMaxStagedBytes ? room : compact_decode::kMaxStagedBytes;
  const auto staged = static_cast<uint32_t>(largest_streams < most ? largest_streams : most);
  err = cudaFuncSetAttribute(compact_decode::decode_blocks, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(most));
  if (err != cudaSuccess) return err;
  compact_decode::decode_blocks<<<num_blocks, compact_decode::kDecodeThreads, staged, stream>>>(tasks, faults, status,
                                                                                              staged);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  constexpr unsigned kThreads = 128;
  compact_decode::check_block_order<<<(num_blocks + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
      tasks, num_blocks, status);
  return cudaGetLastError();
}

#endif  // __CUDACC__

}  // namespace deltasync::cuda::detail
