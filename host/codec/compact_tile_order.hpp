// The order of a tiled tensor's changes (compact_tiles.hpp): encoders code them in coded order
// (band by band, row-major inside a band: ascending coded positions), every decoder hands them
// to the verified apply in flat order (ascending flat positions, which apply requires). CPU
// side; the GPU's twins are in kernels/src/compact_tile_kernels.cuh.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "codec/compact_tiles.hpp"

namespace deltasync::compact {

// One tensor's changes in coded order, cut into tiles: tile t holds changes
// [tile_starts[t], tile_starts[t + 1]). `positions`, `new_bits` and `base_bits` are the coded
// positions and the permuted bits when the tensor has bands, and empty when it has not (the
// flat order is then the coded order).
struct CodedOrder {
  std::vector<int64_t> positions;
  std::vector<uint8_t> new_bits, base_bits;
  std::vector<uint64_t> tile_starts;  // tiles() + 1 entries
};
// `positions` ascending flat positions inside the tensor, `new_bits` and `base_bits` `width`
// bytes per change.
CodedOrder to_coded_order(const TileGeometry& tiles, std::span<const int64_t> positions, std::span<const uint8_t> new_bits,
                          std::span<const uint8_t> base_bits, uint32_t width);

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

// A banded tensor's changes as its blocks decode them: coded order (ascending coded positions).
struct CodedChanges {
  std::span<const int64_t> positions;
  std::span<const uint8_t> new_bits, base_bits;
};
// The same changes in flat order (ascending flat positions), into `out_*` (as long as the
// inputs, distinct from them). With `base` (the whole tensor, `width` bytes per element) the
// changes were decoded without one (new bits against zeros, base bits 0): the base bits are
// gathered at the flat positions -- in ascending order, a stream the hardware prefetcher
// follows, where a gather in coded order stalls on its misses -- and the new bits rebased onto
// them. Without, the bits move as they are.
void to_flat_order(const TileGeometry& tiles, const CodedChanges& coded, uint32_t width, std::span<int64_t> out_positions,
                   std::span<uint8_t> out_new_bits, std::span<uint8_t> out_base_bits, const uint8_t* base = nullptr);

}  // namespace deltasync::compact
