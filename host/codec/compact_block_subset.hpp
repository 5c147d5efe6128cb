// A compact tensor reduced to some of its blocks: what a receiver that holds only part of a tensor
// (a tensor-parallel rank) fetches and decodes. Blocks are independent (docs/compact-format.md),
// so any subset of them, with payload offsets rebased and the header's counts fixed, is itself a
// valid compact tensor that the ordinary decoder reads: it yields exactly the chosen blocks'
// changes.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "codec/compact_block_index.hpp"

namespace deltasync::compact {

// Element positions [begin, end) of one tensor.
struct ElementSpan {
  uint64_t begin = 0, end = 0;
  bool operator==(const ElementSpan&) const = default;
};

// Sorts and merges spans (overlapping or touching), dropping empty ones.
std::vector<ElementSpan> merge_spans(std::vector<ElementSpan> spans);

// The coded positions (compact_tiles.hpp) of the flat positions `flat` (sorted, disjoint), as
// sorted, disjoint spans: the same spans unless the tensor has column bands, where a flat span
// falls into up to three pieces per band (a partial first row, whole rows, a partial last row).
std::vector<ElementSpan> coded_spans(const TileGeometry& tiles, std::span<const ElementSpan> flat);

// The blocks whose changes may lie in `needed` (flat positions: sorted, disjoint spans). Block b's
// changes lie in [first_position[b], first_position[b + 1]) in coded positions, and inside the
// tile of its first change (no block crosses a tile boundary; the last block's span ends at the
// tensor's end), so a block is needed when that span meets a needed span's coded positions.
// Ascending block numbers.
std::vector<uint32_t> blocks_overlapping(const BlockRecords& records, std::span<const ElementSpan> needed);

struct BlockSubset {
  std::vector<uint8_t> block_index;  // NAME.cindex of the reduced tensor
  std::vector<uint8_t> payload;      // NAME.cdata: the chosen blocks' payloads, back to back
  uint64_t changed = 0;
};

// Builds the reduced tensor from the chosen blocks (`chosen` ascending, non-empty) of `records`
// and their payloads (`payloads[k]` is block chosen[k]'s, exactly its payload_bytes()); its index
// keeps the original's version and tiles. The result is validated with parse_block_index. Throws
// BadInputError naming `where` for a payload of the wrong size or a choice out of order.
BlockSubset build_block_subset(const BlockRecords& records, std::span<const uint32_t> chosen,
                               std::span<const std::span<const uint8_t>> payloads, const std::string& where);

}  // namespace deltasync::compact
