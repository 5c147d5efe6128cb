// The order of a tiled tensor's changes (compact_tiles.hpp): encoders code them in coded order
// (band by band, row-major inside a band: ascending coded positions), every decoder hands them
// to the verified apply in flat order (ascending flat positions, which apply requires). CPU
// side; the GPU's twins are in kernels/src/compact_tile_kernels.cuh.
//
// Neither direction puts a whole tensor in the other order first (a pass over memory each way):
// the encoder routes a stripe's changes to per-band buffers of one block each and codes a block
// as soon as it fills (split_stripe); the decoder finds each (row, band) run of a stripe and
// copies the runs in flat order -- inside a run, coded and flat positions differ by a constant
// -- then rebases the stripe in flat order (merge_stripe).
#pragma once
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "codec/compact_tiles.hpp"

namespace deltasync::compact {

// x / d by a multiply with ceil(2^64 / d): exact while x * d < 2^64 (checked once, for the
// largest x the caller will divide), a plain division otherwise. The reorderings below run one
// per change, where a 64-bit division would cost more than the rest of their work.
class Divider {
 public:
  Divider(uint64_t d, uint64_t largest) : d_(d), magic_(d > 1 && (largest == 0 || d <= UINT64_MAX / largest) ? UINT64_MAX / d + 1 : 0) {}
  uint64_t operator()(uint64_t x) const {
    if (magic_ == 0) return d_ == 1 ? x : x / d_;
    return static_cast<uint64_t>((static_cast<unsigned __int128>(x) * magic_) >> 64);
  }

 private:
  uint64_t d_, magic_;
};

// ---- encoder: flat -> coded ----------------------------------------------------------------

// The first change of every stripe (stripes + 1 entries; stripes are contiguous in flat order).
// Without bands these are the tile starts (coded order is flat order).
std::vector<uint64_t> stripe_starts(const TileGeometry& tiles, std::span<const int64_t> positions);

// A banded tensor's stripe `stripe` in coded order, a block at a time: one pass over its changes
// in flat order routes each to its band's buffer (coded position and bits; cache-resident: one
// block per band), and a full buffer -- block_elements changes, or what a band has left at the
// stripe's end -- goes to `block` at once, band k's blocks in their order in tile (k, stripe).
// `positions`, `new_bits` and `base_bits` are the whole tensor's changes in flat order.
using BandBlock = std::function<void(uint32_t band, const int64_t* positions, const uint8_t* new_bits,
                                     const uint8_t* base_bits, uint32_t count)>;
void split_stripe(const TileGeometry& tiles, uint32_t stripe, std::span<const int64_t> positions, const uint8_t* new_bits,
                  const uint8_t* base_bits, uint32_t width, uint32_t block_elements, const BandBlock& block);

// The whole tensor in coded order (tests, and the GPU encoder's twin): `positions`, `new_bits`
// and `base_bits` are the coded positions and permuted bits when the tensor has bands, empty
// when it has not.
struct CodedOrder {
  std::vector<int64_t> positions;
  std::vector<uint8_t> new_bits, base_bits;
  std::vector<uint64_t> tile_starts;  // tiles() + 1 entries
};
CodedOrder to_coded_order(const TileGeometry& tiles, std::span<const int64_t> positions, std::span<const uint8_t> new_bits,
                          std::span<const uint8_t> base_bits, uint32_t width);

// ---- decoder: coded -> flat ----------------------------------------------------------------

// A banded tensor's changes as its blocks decode them: coded order (ascending coded positions),
// new bits and base bits, or new bits decoded against zeros and no base bits (empty: the
// unbased decoding of compact_two_phase.hpp, which is what the CPU decoder does with bands).
struct CodedChanges {
  std::span<const int64_t> positions;
  std::span<const uint8_t> new_bits, base_bits;
};
// Readable changes a merge_stripe input needs past a tile's last change (it copies runs a few
// changes at a time).
inline constexpr size_t kMergeSlack = 3;
// The changes of stripe `stripe` in flat order into `out_*` (exactly the changes of that
// stripe's tiles, `width` bytes per change for the bits); `tile_starts` (tiles() + 1 entries) cut
// `coded` into tiles, whose arrays stay readable kMergeSlack changes past their end. With `base` (the whole tensor, `width` bytes per element; `coded` then has
// no base bits) the new bits are rebased onto the base bits at the flat positions, gathered in
// ascending order, and out_base_bits get those; without, the bits move as they are (base bits
// zeros when `coded` has none, or none written when out_base_bits is empty).
void merge_stripe(const TileGeometry& tiles, uint32_t stripe, std::span<const uint64_t> tile_starts, const CodedChanges& coded,
                  uint32_t width, std::span<int64_t> out_positions, std::span<uint8_t> out_new_bits,
                  std::span<uint8_t> out_base_bits, const uint8_t* base = nullptr);

// The whole tensor in flat order (tests, and the GPU decoder's twin), as merge_stripe does it
// stripe by stripe; the tile starts are found from the positions, and `coded` needs no slack.
// Outputs as long as the inputs.
void to_flat_order(const TileGeometry& tiles, const CodedChanges& coded, uint32_t width, std::span<int64_t> out_positions,
                   std::span<uint8_t> out_new_bits, std::span<uint8_t> out_base_bits, const uint8_t* base = nullptr);

}  // namespace deltasync::compact
