// The reorderings of tiled tensors (compact_tile_order.cpp) where their per-change work is
// bookkeeping that AVX-512 does eight changes or one row at a time. The scalar loops of
// compact_tile_order.cpp are the reference and take what these leave. Taken when
// simd_blocks_supported() (compact_block_simd.hpp).
//
// Decoder: merge_stripe's run walk for a stripe of eight bands, one row per step. Each band's
// run of a row is at most four changes at ~1% density (1.3 on average for 1024 columns), and the
// scalar walk spent ~8 cycles of bookkeeping per run on them. Here a row's eight runs are found,
// placed and copied together: four changes are loaded from every band and the row's runs
// compressed into place (vpcompressq), whatever their lengths. Rows with a longer run, and the
// stripe's last rows, are left to the scalar walk.
//
// Encoder: split_stripe's first pass, each change's band and coded position (a division by the
// band width per change), eight changes at a time.
#pragma once
#include <array>
#include <cstdint>

namespace deltasync::compact::detail {

inline constexpr uint32_t kSimdRunBands = 8;
inline constexpr uint64_t kSimdRunChanges = 4;  // the longest run the SIMD walk copies

struct RunWalk {
  const uint64_t* run_end;  // row r's run in band k ends before run_end[r * 8 + k] (0: the band's first row with none)
  const int64_t* coded;     // coded positions of the stripe's tiles, readable 3 changes past each tile's end
  const uint8_t* new_bits;  // `width` bytes per change, the same
  const uint8_t* base_bits;  // the same, or nullptr: no base bits move
  // flat position = coded + row_shift + row * row_step + band_shift[band] (row counted in the stripe)
  int64_t row_shift = 0, row_step = 0;
  std::array<int64_t, kSimdRunBands> band_shift{};
  int64_t* out_positions;
  uint8_t* out_new_bits;
  uint8_t* out_base_bits;  // written when base_bits is not nullptr
  uint64_t out_count = 0;
  uint64_t numel = 0;  // the tensor's elements: every flat position is below
};

// Walks rows [row, rows) for as long as each has runs of at most kSimdRunChanges changes and
// room for 8 more changes' output before out_count; advances from[8] (each band's next change)
// and at (the next output slot). Returns the first row not walked.
uint64_t walk_runs8(const RunWalk& walk, uint32_t width, uint64_t row, uint64_t rows, uint64_t* from, uint64_t& at);

// Flat positions [0, count) (below 2^40; count a multiple of 8) of a tensor cut into
// `bands` bands of band_width columns, each band_elements long: band[j] = the band of
// positions[j], coded[j] = its coded position (TileGeometry::coded).
inline constexpr uint64_t kSimdSplitLimit = uint64_t{1} << 40;
void band_and_coded8(const int64_t* positions, uint64_t count, uint32_t bands, uint64_t band_width, uint64_t band_elements,
                     uint8_t* band, int64_t* coded);

}  // namespace deltasync::compact::detail
