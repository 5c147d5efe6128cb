// Which byte ranges of a delta a receiver that holds only part of the model (a tensor- or
// expert-parallel rank) must read, planned from what it needs and what the object's header and
// block indexes say -- pure functions, no store: the subscriber's ranged fetch
// (sync/ranged_fetch.hpp) runs them between its reads, and a benchmark can count a rank's bytes
// from headers and indexes alone.
//
// A compact delta (docs/compact-format.md) is read in two steps after its header: the NAME.cindex
// of every tensor the receiver needs (and, for a delta part, the part holds), then only the blocks
// whose position span meets the needed elements. Every range is rounded out to whole chunks of the
// object's chunk hashes (sync/range_hashes.hpp), so each byte can be verified, and ranges that
// touch are merged into one request. A tiled tensor (codec/compact_tiles.hpp) is planned in its
// coded positions: a rank needs the blocks of the tiles its elements fall in.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "codec/compact_block_subset.hpp"
#include "core/placement.hpp"
#include "sync/protocol.hpp"
#include "sync/range_hashes.hpp"

namespace deltasync::ranged {

using compact::ElementSpan;

// The flat elements of one published tensor a receiver holds: sorted, disjoint, non-empty spans;
// `shape` is the tensor's (a tiled tensor's block index is read against it).
struct NeededTensor {
  std::vector<uint64_t> shape;
  std::vector<ElementSpan> spans;
};
// Per published tensor. Empty spans: none of its elements, its digests only (a tied lm_head this
// receiver does not write: an indexed delta's record); absent: not needed at all.
using NeededRanges = std::map<std::string, NeededTensor, std::less<>>;

using compact::merge_spans;

// Bytes [offset, offset + length) of an object's data section.
struct ByteRange {
  uint64_t offset = 0, length = 0;
  uint64_t end() const { return offset + length; }
  bool operator==(const ByteRange&) const = default;
};

// `ranges` rounded out to whole chunks (`chunk_ends`: SealedHeader::chunk_ends, the last one the
// data section's end), sorted, and merged where they overlap or touch. Throws BadInputError for a
// range past the data.
std::vector<ByteRange> whole_chunks(std::vector<ByteRange> ranges, std::span<const uint64_t> chunk_ends);

// Fewer requests: a request costs about as much as reading `gap_bytes` more (S3 and HF buckets
// answer a GET in ~10-30 ms, in which a stream moves ~64-256 KiB), so two ranges at most that many
// bytes apart are read as one, the bytes between fetched and dropped. Block reads also keep what
// one merged read drops within 1/kGapShare of what it was asked for (GapCap below): without that
// a tensor-parallel rank would read the other ranks' tiles between its own (a tile of a 0.6B
// model's projection is ~6-20 KB). Measured: benchmarks/results/scale-model-2026-12-03-2.md.
inline constexpr uint64_t kDefaultGapBytes = uint64_t{256} << 10;
inline constexpr uint64_t kGapShare = 8;
// Whether a merged read's gap bytes are capped at 1/kGapShare of its ranges' bytes: for reads of
// blocks, where what lies between is other ranks' data; metadata reads (the indexed layout's
// record pages and block index entries: small, between them only other tensors' records) follow
// the request cost alone.
enum class GapCap { kShare, kNone };
// `ranges` sorted and merged where they overlap or touch, and across gaps of at most `gap_bytes`
// (under GapCap::kShare while a merged read's gap bytes stay at most 1/kGapShare of its ranges').
std::vector<ByteRange> merge_gaps(std::vector<ByteRange> ranges, uint64_t gap_bytes, GapCap cap = GapCap::kShare);

// True when some position of `placement` lies in one of `spans` (sorted, disjoint).
bool placement_overlaps(const Placement& placement, std::span<const ElementSpan> spans);

// Which part of a sharded delta an object is: its changes lie where the manifest's placements put
// part `part`. No placements: a whole delta (every tensor whole).
struct PartScope {
  const protocol::PartPlacements* placements = nullptr;
  size_t part = 0;
};

// Step 1: the compact tensors of a sealed header to read -- those needed and, for a delta part,
// placed in this part where they meet the needed spans -- in file order,
// with the data ranges of their NAME.cindex entries. Throws BadInputError naming `label` for a
// header that is not a compact delta (an unpaired .cindex/.cdata).
struct IndexReads {
  std::vector<std::string> tensors;
  std::vector<ByteRange> ranges;  // ranges[k]: tensors[k]'s NAME.cindex
};
IndexReads plan_index_reads(const SealedHeader& header, const NeededRanges& needed, const PartScope& scope, const std::string& label);

// Step 2: of one tensor, the blocks whose span meets the needed elements, and their payloads'
// data ranges (ranges[k]: block chosen[k]'s).
struct BlockReads {
  std::string tensor;
  compact::BlockRecords records;
  std::vector<uint32_t> chosen;
  std::vector<ByteRange> ranges;
};
// `cindex`: the tensor's NAME.cindex bytes (verified). Throws BadInputError for a bad index.
BlockReads plan_block_reads(const SealedHeader& header, const std::string& tensor, std::span<const uint8_t> cindex,
                            const NeededTensor& needed, const std::string& label);

// What one receiver reads of one sealed compact delta object, in bytes and requests, given its
// header and the block indexes of the tensors plan_index_reads names (`cindex(name)` returns
// them): the header prefix, then the index chunks, then the block chunks.
struct ObjectReadPlan {
  uint64_t header_bytes = 0;
  std::vector<ByteRange> index_chunks;  // whole chunks, merged
  std::vector<BlockReads> blocks;       // tensors with at least one block chosen
  std::vector<ByteRange> block_chunks;  // whole chunks, merged
  uint64_t bytes() const;
  uint64_t requests() const { return 1 + index_chunks.size() + block_chunks.size(); }  // the header in one read
};
// Chunks whose gaps are at most `gap_bytes` are read as one (merge_gaps).
ObjectReadPlan plan_object_reads(const SealedHeader& header, const NeededRanges& needed, const PartScope& scope,
                                 const std::function<std::span<const uint8_t>(const std::string&)>& cindex, const std::string& label,
                                 uint64_t gap_bytes = 0);

// A version's reads, object by object of protocol::delta_objects(manifest): `headers[k]` is
// object k's sealed header, `cindex(k, tensor)` that tensor's NAME.cindex in it; a delta part is
// planned with its placements. Throws BadInputError for a header count that differs.
std::vector<ObjectReadPlan> plan_delta_reads(
    const protocol::Manifest& manifest, std::span<const SealedHeader> headers, const NeededRanges& needed,
    const std::function<std::span<const uint8_t>(size_t, const std::string&)>& cindex);

}  // namespace deltasync::ranged
