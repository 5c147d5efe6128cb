// The order of a tiled tensor's changes (compact_tiles.hpp): encoders code them in coded order
// (band by band, row-major inside a band: ascending coded positions), every decoder hands them
// to the verified apply in flat order (ascending flat positions, which apply requires). CPU
// side; the GPU decoder's twin is kernels/src/compact_untile_kernels.cuh.
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

// Changes decoded in coded order -- `positions` ascending coded positions (validated), `new_bits`
// decoded against the bits `base_bits` holds (whatever the decoder gathered at the coded
// positions, e.g. zeros) -- put in flat order in place: flat positions ascending, base_bits
// gathered from `base` (the whole tensor, `width` bytes per element) at them, new bits rebased
// onto those. A tensor without bands is left as it is.
void to_flat_order(const TileGeometry& tiles, std::span<int64_t> positions, std::span<uint8_t> new_bits,
                   std::span<uint8_t> base_bits, const uint8_t* base, uint32_t width);

}  // namespace deltasync::compact
