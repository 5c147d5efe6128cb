// A receiver that holds only part of the model reads only what it holds of a compact delta, each
// piece checked before use, and gets back an ordinary, smaller compact delta of the same layout --
// the chosen blocks of each tensor (codec/compact_block_subset.hpp) and the promises (digests,
// a part's partials) of the tensors it needs -- that the existing decoder and verified apply take
// as they are: the changes it lacks lie outside this rank's elements.
//
// Both compact layouts start alike: two ranged GETs, the header's length and the header, checked
// against the manifest's header_sha256 (the indexed layout then reads its presence bitmap and
// record page hashes, right behind the header, in one more).
//   Layout 1 (NAME.cindex / NAME.cdata, sealed with chunk hashes in the header): the block
//   indexes of the tensors it needs, then the blocks that meet its elements (sync/ranged_plan.hpp),
//   in whole chunks, each chunk checked against the header's hashes.
//   Layout 2 (the indexed layout, codec/compact_indexed.hpp): the record pages of the tensors it
//   needs (every record's digests count, whichever part holds its elements), then the block
//   index entries of those whose placement in this part meets its elements, then the blocks
//   that meet them -- each page, entry and block checked against its hash from the step before.
// Ranges at most ReadOptions::gap_bytes apart are read as one request (ranged::merge_gaps).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "codec/compact_table.hpp"
#include "core/placement.hpp"
#include "store/store.hpp"
#include "sync/protocol.hpp"
#include "sync/ranged_plan.hpp"

namespace deltasync::ranged {

struct ReadOptions {
  // The receiver's model: the indexed layout numbers tensors by it (refused when its table's
  // hash differs from the object's). Required for indexed objects.
  const compact::TensorTable* table = nullptr;
  uint64_t gap_bytes = kDefaultGapBytes;
};

struct RangedDelta {
  std::vector<uint8_t> file;  // the reduced compact delta (safetensors bytes)
  uint64_t bytes_fetched = 0;
  uint64_t requests = 0;
  // Where the bytes went: the first read(s) (header; the indexed layout's bitmap and page
  // hashes), the index reads (block indexes; the indexed layout's records and entries), blocks.
  uint64_t head_bytes = 0, index_bytes = 0, block_bytes = 0;
  std::vector<BlockReads> blocks;  // per tensor with blocks chosen: which ones, and their ranges
};

// True when `ref` can be read by ranges: sealed (header_sha256 recorded) and of the compact layout.
bool can_read_ranged(const protocol::ObjectRef& ref, const std::string& delta_format);

// Bytes [offset, offset + length) of the object (a ranged GET).
using RangeGet = std::function<std::vector<uint8_t>(uint64_t offset, uint64_t length)>;

// Reads what `needed` requires of the sealed compact delta `ref` through `get` (`scope`: which part
// of a sharded delta it is; none for a whole delta). Throws BadInputError naming `label` for
// anything that does not verify (header, a chunk, a record page, an entry, a block) or parse;
// nothing is returned then.
RangedDelta read_needed(const RangeGet& get, const protocol::ObjectRef& ref, const NeededRanges& needed, const PartScope& scope,
                        const ReadOptions& options, const std::string& label);
// read_needed through the store's ranged GETs, labelled with the object's name.
RangedDelta fetch_needed(Store& store, const protocol::ObjectRef& ref, const NeededRanges& needed, const PartScope& scope,
                         const ReadOptions& options = {});

}  // namespace deltasync::ranged
