// Where a sealed object's chunks end (sync/range_hashes.hpp): a reader verifies whole chunks, so
// the chunks of a tensor-parallel rank's reads should begin and end where those reads do. Chunk
// boundaries are placed
//   - at every tensor entry of the data section (a block index is read whole, its neighbours not);
//   - inside a compact tensor's NAME.cdata at block boundaries: consecutive blocks grouped up to
//     `target` bytes, never two tiles in one chunk (codec/compact_tiles.hpp), so that a rank that
//     reads whole tiles, or whole blocks, reads only its own bytes; a block larger than `target`
//     is a chunk of its own;
//   - in any other entry (a block index, a tensor of another layout, a compact tensor whose
//     index does not parse against its recorded shape) every `target` bytes from its start.
#pragma once
#include <cstdint>
#include <vector>

#include "format/safetensors.hpp"

namespace deltasync::ranged {

// The end offset of every chunk of `file`'s data section (`data_bytes` long), ascending, the last
// one data_bytes (none for an empty data section).
std::vector<uint64_t> chunk_ends(const st::File& file, uint64_t data_bytes, uint64_t target);

}  // namespace deltasync::ranged
