// Tiles of a compact tensor (docs/compact-format.md, "Tiles"): why a tensor-parallel rank can
// read only its own blocks. A tensor of two or more dimensions is seen as a matrix
// [rows = product of all dimensions but the last, cols = the last]; vLLM splits a
// column-parallel weight by rows and a row-parallel one by columns. A tiled tensor is cut into
// `bands` column bands of equal width and `stripes` row stripes of equal height, and
//   - its changes are coded band by band, row-major inside a band: change (r, c) of band
//     k = c / W (W = cols / bands) has the coded position q = k*rows*W + r*W + c % W, a
//     permutation of the flat positions in which every tile (band k, stripe s) is one
//     contiguous range [k*rows*W + s*(rows/stripes)*W, + (rows/stripes)*W);
//   - no block crosses a tile boundary.
// The block coder is unchanged: it codes ascending coded positions, so every rule of the block
// index holds as before (first positions ascending and inside the tensor). Untiled tensors
// (bands = stripes = 1) have q = p, as before tiles existed; stripes alone permute nothing.
// Written once for the CPU codec and its GPU twin: under nvcc these are __host__ __device__.
#pragma once
#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "codec/compact_symbols.hpp"  // DELTASYNC_HOST_DEVICE

namespace deltasync::compact {

struct TileGeometry {
  uint64_t rows = 1, cols = 1;
  uint32_t bands = 1, stripes = 1;

  DELTASYNC_HOST_DEVICE uint64_t band_width() const { return cols / bands; }
  DELTASYNC_HOST_DEVICE uint64_t band_elements() const { return rows * band_width(); }
  DELTASYNC_HOST_DEVICE uint64_t stripe_rows() const { return rows / stripes; }
  DELTASYNC_HOST_DEVICE uint32_t tiles() const { return bands * stripes; }
  // Coded position of flat position p, and back.
  DELTASYNC_HOST_DEVICE uint64_t coded(uint64_t p) const {
    if (bands == 1) return p;
    const uint64_t w = band_width(), c = p % cols;
    return c / w * band_elements() + p / cols * w + c % w;
  }
  DELTASYNC_HOST_DEVICE uint64_t flat(uint64_t q) const {
    if (bands == 1) return q;
    const uint64_t w = band_width(), in_band = q % band_elements();
    return in_band / w * cols + q / band_elements() * w + in_band % w;
  }
  // Tile k * stripes + s of coded position q, and the coded positions [begin, end) of a tile.
  DELTASYNC_HOST_DEVICE uint64_t tile_of(uint64_t q) const {
    return q / band_elements() * stripes + q % band_elements() / band_width() / stripe_rows();
  }
  DELTASYNC_HOST_DEVICE uint64_t tile_begin(uint64_t tile) const {
    return tile / stripes * band_elements() + tile % stripes * stripe_rows() * band_width();
  }
  DELTASYNC_HOST_DEVICE uint64_t tile_end(uint64_t tile) const { return tile_begin(tile) + stripe_rows() * band_width(); }
};

// rows and cols of a shape: a 1-D tensor is one row; a scalar one element.
inline TileGeometry tensor_geometry(std::span<const uint64_t> shape, uint32_t bands = 1, uint32_t stripes = 1) {
  TileGeometry g;
  g.bands = bands;
  g.stripes = stripes;
  if (shape.empty()) return g;
  g.cols = shape.back();
  for (size_t d = 0; d + 1 < shape.size(); ++d) g.rows *= shape[d];
  return g;
}

inline bool is_tile_count(uint32_t n) { return n >= 1 && n <= 8 && (n & (n - 1)) == 0; }

// Why `bands` x `stripes` tiles cannot cut a tensor of `shape` (a reader's check of a block
// index), or nothing: each a power of two <= 8, bands dividing the columns, stripes the rows of
// a tensor of two or more dimensions.
inline std::optional<std::string> tiles_unfit(std::span<const uint64_t> shape, uint32_t bands, uint32_t stripes) {
  if (!is_tile_count(bands) || !is_tile_count(stripes))
    return "bands " + std::to_string(bands) + " and stripes " + std::to_string(stripes) + " are not 1, 2, 4 or 8";
  if (bands * stripes == 1) return std::nullopt;
  const TileGeometry g = tensor_geometry(shape);
  if (shape.size() < 2) return std::to_string(bands) + " x " + std::to_string(stripes) + " tiles for a tensor of fewer than 2 dimensions";
  if (g.cols % bands != 0) return std::to_string(bands) + " bands do not divide " + std::to_string(g.cols) + " columns";
  if (g.rows % stripes != 0) return std::to_string(stripes) + " stripes do not divide " + std::to_string(g.rows) + " rows";
  return std::nullopt;
}

// The writers' rule (the CPU codec and its GPU twin run this one function, so they cut alike).
// Bands and stripes grow together, 1x1 -> 2x2 -> 4x4 -> 8x8 (each a power of two up to
// `max_tiles` that divides the columns, or the rows; one that cannot grow stops and the other
// goes on alone), because a tensor-parallel rank benefits only from cuts along its own split: column
// bands for a row-parallel weight, row stripes for a column-parallel one, and the writer knows
// neither. They grow while every tile holds, on average, at least min(block_elements,
// kMinTileChanges) changes: each tile ends in a partial block, whose tables and record (~150-200
// bytes) must stay small beside the tile (measured: benchmarks/results/ranged-fetch-2026-12-03.md).
// Tensors of fewer than two dimensions get one tile.
inline constexpr uint64_t kMinTileChanges = 4096;
inline TileGeometry choose_tiles(std::span<const uint64_t> shape, uint64_t changed, uint32_t block_elements, uint32_t max_tiles) {
  TileGeometry g = tensor_geometry(shape);
  if (shape.size() < 2 || block_elements == 0) return g;
  const uint64_t most = changed / std::min<uint64_t>(block_elements, kMinTileChanges);
  for (;;) {
    const bool more_bands = g.bands * 2 <= max_tiles && g.cols % (g.bands * 2) == 0;
    const bool more_stripes = g.stripes * 2 <= max_tiles && g.rows % (g.stripes * 2) == 0;
    const uint64_t next = uint64_t{g.tiles()} << (int{more_bands} + int{more_stripes});
    if (next == g.tiles() || next > most) break;
    g.bands <<= int{more_bands};
    g.stripes <<= int{more_stripes};
  }
  return g;
}

}  // namespace deltasync::compact
