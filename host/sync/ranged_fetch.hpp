// A receiver that holds only part of the model reads only what it holds of a compact delta:
// the header (one ranged GET, checked against the manifest's header_sha256), the block indexes of
// the tensors it needs, then the blocks that meet its elements (sync/ranged_plan.hpp), each chunk
// checked against the header's hashes before use. What it returns is an ordinary, smaller compact
// delta -- the chosen blocks of each tensor (codec/compact_block_subset.hpp) and the original
// metadata (promises, partials) -- that the existing decoder and verified apply take as they are:
// the changes it lacks lie outside this rank's elements.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/placement.hpp"
#include "store/store.hpp"
#include "sync/protocol.hpp"
#include "sync/ranged_plan.hpp"

namespace deltasync::ranged {

struct RangedDelta {
  std::vector<uint8_t> file;  // the reduced compact delta (safetensors bytes)
  uint64_t bytes_fetched = 0;
  uint64_t requests = 0;
};

// True when `ref` can be read by ranges: sealed (header_sha256 recorded) and of the compact layout.
bool can_read_ranged(const protocol::ObjectRef& ref, const std::string& delta_format);

// Reads what `needed` requires of the sealed compact delta `ref` (`scope`: which part of a sharded
// delta it is; none for a whole delta). Throws BadInputError naming the object for anything that does not
// verify (header, a chunk) or parse; nothing is returned then.
RangedDelta fetch_needed(Store& store, const protocol::ObjectRef& ref, const NeededRanges& needed, const PartScope& scope);

}  // namespace deltasync::ranged
