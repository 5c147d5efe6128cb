// Kernels of tiled compact tensors (host/codec/compact_tiles.hpp), the GPU twin of
// host/codec/compact_tile_order.cpp: the encoder puts a banded tensor's changes in coded order
// (band by band, row-major inside a band) and finds where each tile starts; the decoder puts
// them back in flat order on the real base bits. Both reorderings are a scatter whose
// destinations come from counts of (band, row) segments and one exclusive scan:
//   encoder, banded tensors
//     1. band_row_counts  one thread per (band k, row r) of every banded tensor, band-major: the
//                         changes of band k in row r (two binary searches in the flat positions)
//     2. (CUB exclusive scan: each segment's first index in coded order)
//     3. to_coded         one thread per change: destination = its segment's start + its rank
//                         inside the segment; writes the coded position and both bits there
//   encoder, tiled tensors
//     4. tile_starts      one thread per tile: where it starts among the coded positions
//   decoder, banded tensors (after decode_blocks and check_block_order)
//     5. row_band_counts  one thread per (row r, band k), row-major: the changes of band k in
//                         row r (two binary searches in the decoded coded positions)
//     6. (CUB exclusive scan: each segment's first index in flat order)
//     7. to_flat          one thread per change: flat position, base bits gathered there, new
//                         bits rebased onto them (compact::rebase_value), at its destination
// Segments and changes are numbered across the tensors of one launch (TiledTensor::first_*), so
// each step is one launch for the whole delta. The decoder's kernels do nothing when the decode
// found a fault: positions are then unvalidated. The per-item arithmetic is host/device, so a
// test runs it on the host against the CPU twin; the kernels and launchers are in compact_tiles.cu.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "codec/compact_symbols.hpp"
#include "codec/compact_tiles.hpp"
#include "compact_decode_status.cuh"

namespace deltasync::cuda::detail {

// One tiled tensor of a launch (device pointers).
struct TiledTensor {
  const int64_t* positions;  // n ascending: flat (encoder) or coded (decoder) positions
  const uint8_t* new_bits;   // n * width
  const uint8_t* base_bits;  // n * width (decoder: what the block decoder gathered, at the coded positions)
  const uint8_t* base;       // decoder: the whole base tensor
  int64_t* out_positions;    // n: coded (encoder) or flat (decoder) positions
  uint8_t* out_new_bits;
  uint8_t* out_base_bits;
  uint64_t n;
  uint64_t first_change;   // this tensor's changes are launch items [first_change, + n)
  uint64_t first_segment;  // its segments are [first_segment, + rows * bands)
  uint64_t first_tile;     // its tiles are [first_tile, + tiles)
  compact::TileGeometry tiles;
  uint32_t width;
};

namespace compact_tiles {

// First i in [0, n) with a[i] >= key, or n.
DELTASYNC_HOST_DEVICE inline uint64_t lower_bound(const int64_t* a, uint64_t n, uint64_t key) {
  uint64_t lo = 0, hi = n;
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo) / 2;
    if (static_cast<uint64_t>(a[mid]) < key) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// The tensor whose items [first, first + count) hold `item`: the last with first <= item
// (`first`: TiledTensor::first_change, first_segment or first_tile).
DELTASYNC_HOST_DEVICE inline uint32_t tensor_of(const TiledTensor* tensors, uint32_t num_tensors, uint64_t item,
                                                uint64_t TiledTensor::*first) {
  uint32_t lo = 0, hi = num_tensors;
  while (hi - lo > 1) {
    const uint32_t mid = lo + (hi - lo) / 2;
    if (tensors[mid].*first <= item) lo = mid; else hi = mid;
  }
  return lo;
}

DELTASYNC_HOST_DEVICE inline uint32_t load_bits(const uint8_t* p, uint32_t width) {
  uint32_t v = 0;
  for (uint32_t b = 0; b < width; ++b) v |= uint32_t{p[b]} << (8 * b);
  return v;
}
DELTASYNC_HOST_DEVICE inline void store_bits(uint8_t* p, uint32_t v, uint32_t width) {
  for (uint32_t b = 0; b < width; ++b) p[b] = static_cast<uint8_t>(v >> (8 * b));
}
DELTASYNC_HOST_DEVICE inline void copy_bits(uint8_t* dst, const uint8_t* src, uint32_t width) {
  for (uint32_t b = 0; b < width; ++b) dst[b] = src[b];
}

// ---- encoder: flat -> coded order --------------------------------------------------------

// Segment s (band-major: s = k * rows + r) of a banded tensor: its changes, band k of row r.
DELTASYNC_HOST_DEVICE inline uint64_t band_row_count(const TiledTensor& t, uint64_t s) {
  const compact::TileGeometry& g = t.tiles;
  const uint64_t k = s / g.rows, r = s % g.rows, w = g.band_width();
  return lower_bound(t.positions, t.n, r * g.cols + (k + 1) * w) - lower_bound(t.positions, t.n, r * g.cols + k * w);
}

// Change i of a banded tensor to its place in coded order; `segment_start` is the exclusive scan
// of the launch's band_row_counts (so its values count from the launch's first change).
DELTASYNC_HOST_DEVICE inline void to_coded_one(const TiledTensor& t, uint64_t i, const uint64_t* segment_start) {
  const compact::TileGeometry& g = t.tiles;
  const auto p = static_cast<uint64_t>(t.positions[i]);
  const uint64_t w = g.band_width(), r = p / g.cols, k = p % g.cols / w;
  const uint64_t segment_first = lower_bound(t.positions, t.n, r * g.cols + k * w);
  const uint64_t dest = segment_start[t.first_segment + k * g.rows + r] - t.first_change + (i - segment_first);
  t.out_positions[dest] = static_cast<int64_t>(g.coded(p));
  copy_bits(t.out_new_bits + dest * t.width, t.new_bits + i * t.width, t.width);
  copy_bits(t.out_base_bits + dest * t.width, t.base_bits + i * t.width, t.width);
}

// Where tile j of a tiled tensor starts among its coded positions (`coded`: out_positions of a
// banded tensor, positions of one with stripes only).
DELTASYNC_HOST_DEVICE inline uint64_t tile_start(const TiledTensor& t, const int64_t* coded, uint32_t j) {
  return lower_bound(coded, t.n, t.tiles.tile_begin(j));
}

// ---- decoder: coded -> flat order --------------------------------------------------------

// Segment s (row-major: s = r * bands + k) of a banded tensor: its changes, band k of row r.
DELTASYNC_HOST_DEVICE inline uint64_t row_band_count(const TiledTensor& t, uint64_t s) {
  const compact::TileGeometry& g = t.tiles;
  const uint64_t r = s / g.bands, k = s % g.bands, w = g.band_width();
  return lower_bound(t.positions, t.n, k * g.band_elements() + (r + 1) * w) -
         lower_bound(t.positions, t.n, k * g.band_elements() + r * w);
}

DELTASYNC_HOST_DEVICE inline void to_flat_one(const TiledTensor& t, uint64_t i, const uint64_t* segment_start) {
  const compact::TileGeometry& g = t.tiles;
  const auto q = static_cast<uint64_t>(t.positions[i]);
  const uint64_t w = g.band_width(), k = q / g.band_elements(), r = q % g.band_elements() / w;
  const uint64_t segment_first = lower_bound(t.positions, t.n, k * g.band_elements() + r * w);
  const uint64_t dest = segment_start[t.first_segment + r * g.bands + k] - t.first_change + (i - segment_first);
  const uint64_t p = g.flat(q);
  const uint32_t base = load_bits(t.base + p * t.width, t.width);
  const uint32_t bits = compact::rebase_value(load_bits(t.new_bits + i * t.width, t.width),
                                              load_bits(t.base_bits + i * t.width, t.width), base, t.width);
  t.out_positions[dest] = static_cast<int64_t>(p);
  store_bits(t.out_new_bits + dest * t.width, bits, t.width);
  store_bits(t.out_base_bits + dest * t.width, base, t.width);
}

}  // namespace compact_tiles

// Launchers (compact_tiles.cu): all on `stream`, no synchronization.
// `counts`: num_segments + 1 entries; band_major: the encoder's segments, else the decoder's.
// `status`: the decoder's (its kernels skip a failed decode), nullptr for the encoder.
cudaError_t launch_tile_segment_counts(bool band_major, const TiledTensor* tensors, uint32_t num_tensors, uint64_t num_segments,
                                       uint64_t* counts, const CompactDecodeStatus* status, cudaStream_t stream);
// to_coded: the encoder's reorder (flat -> coded order), else the decoder's.
cudaError_t launch_tile_reorder(bool to_coded, const TiledTensor* tensors, uint32_t num_tensors, uint64_t num_changes,
                                const uint64_t* segment_start, const CompactDecodeStatus* status, cudaStream_t stream);
cudaError_t launch_tile_starts(const TiledTensor* tensors, uint32_t num_tensors, uint64_t num_tiles, uint64_t* starts,
                               cudaStream_t stream);

}  // namespace deltasync::cuda::detail
