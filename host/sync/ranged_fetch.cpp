#include "sync/ranged_fetch.hpp"

#include <algorithm>

#include "codec/compact_indexed.hpp"
#include "core/error.hpp"
#include "format/safetensors.hpp"
#include "sync/range_reader.hpp"

namespace deltasync::ranged {
namespace {

// Layout 1: the block indexes of the needed tensors, then the chosen blocks, in whole chunks each
// checked against the header's hashes. Ranges are data-section offsets here.
void read_chunked(RangeReader& reader, const SealedHeader& header, const NeededRanges& needed, const PartScope& scope,
                  const ReadOptions& options, const std::string& label, RangedDelta& out) {
  auto fetch = [&](const std::vector<ByteRange>& ranges) {
    uint64_t bytes = 0;
    for (const ByteRange& r : ranges) {
      const ByteRange in_object{header.data_offset + r.offset, r.length};
      bytes += reader.fetch(std::span(&in_object, 1));  // what earlier reads did not bring
      verify_chunks(header, r.offset, reader.view(in_object), label);
    }
    return bytes;
  };
  auto view = [&](ByteRange r) { return reader.view({header.data_offset + r.offset, r.length}); };

  const IndexReads index = plan_index_reads(header, needed, scope, label);
  out.index_bytes = fetch(merge_gaps(whole_chunks(index.ranges, header.chunk_ends), options.gap_bytes));
  auto cindex = [&](const std::string& tensor) {
    const st::TensorInfo* t = header.find(tensor + ".cindex");
    return view({t->begin, t->nbytes()});
  };
  ObjectReadPlan plan = plan_object_reads(header, needed, scope, cindex, label, options.gap_bytes);
  out.block_bytes = fetch(plan.block_chunks);

  std::vector<st::WriteTensor> writes;
  std::vector<compact::BlockSubset> subsets;
  subsets.reserve(plan.blocks.size());
  uint64_t changed = 0;
  for (const BlockReads& reads : plan.blocks) {
    std::vector<std::span<const uint8_t>> payloads;
    for (const ByteRange& r : reads.ranges) payloads.push_back(view(r));
    subsets.push_back(compact::build_block_subset(reads.records, reads.chosen, payloads, label + ": tensor " + reads.tensor));
    changed += subsets.back().changed;
    const std::string& name = reads.tensor;
    writes.push_back({name + ".cindex", DType::U8, {subsets.back().block_index.size()}, subsets.back().block_index});
    writes.push_back({name + ".cdata", DType::U8, {subsets.back().payload.size()}, subsets.back().payload});
  }
  // The original metadata (promises, a part's partials, tensor shapes), with the change count of
  // what this file holds: the decoder checks the blocks against it.
  st::Metadata metadata = header.metadata;
  if (metadata.count("total_changed_elements")) metadata["total_changed_elements"] = std::to_string(changed);
  out.file = st::serialize(writes, metadata);
  out.blocks = std::move(plan.blocks);
}

}  // namespace

RangeReader::RangeReader(const RangeGet& get, uint64_t object_size, std::string label)
    : get_(get), object_size_(object_size), label_(std::move(label)) {}

bool RangeReader::holds(ByteRange r) const {
  auto it = held_.upper_bound(r.offset);
  if (it == held_.begin()) return false;
  --it;
  return r.end() <= it->first + it->second.size();
}

std::span<const uint8_t> RangeReader::view(ByteRange r) const {
  auto it = held_.upper_bound(r.offset);
  if (it == held_.begin() || r.end() > std::prev(it)->first + std::prev(it)->second.size())
    throw Error(label_ + ": internal: byte range [" + std::to_string(r.offset) + ", +" + std::to_string(r.length) + ") not fetched");
  --it;
  return std::span<const uint8_t>(it->second).subspan(r.offset - it->first, r.length);
}

uint64_t RangeReader::fetch(std::span<const ByteRange> ranges) {
  uint64_t fetched = 0;
  for (const ByteRange& wanted : ranges) {
    // Only the part not held yet: a range's head or tail may lie in an earlier read.
    ByteRange r = wanted;
    if (auto it = held_.upper_bound(r.offset); it != held_.begin() && std::prev(it)->first + std::prev(it)->second.size() > r.offset) {
      const uint64_t held_end = std::prev(it)->first + std::prev(it)->second.size();
      if (held_end >= r.end()) continue;
      r = {held_end, r.end() - held_end};
    }
    if (auto next = held_.lower_bound(r.offset); next != held_.end() && next->first < r.end()) r.length = next->first - r.offset;
    if (r.length == 0) continue;
    if (r.offset > object_size_ || r.length > object_size_ - r.offset)
      throw BadInputError(label_ + ": byte range [" + std::to_string(r.offset) + ", +" + std::to_string(r.length) + ") runs past the object's " +
                          std::to_string(object_size_) + " bytes");
    std::vector<uint8_t> bytes = get_(r.offset, r.length);
    ++requests_;
    bytes_ += bytes.size();
    fetched += bytes.size();
    if (bytes.size() != r.length)
      throw BadInputError(label_ + ": ranged read of [" + std::to_string(r.offset) + ", +" + std::to_string(r.length) + ") returned " +
                          std::to_string(bytes.size()) + " bytes (object shorter than its manifest says)");
    // Kept joined with the spans it touches, so that any range read is one span.
    auto at = held_.emplace(r.offset, std::move(bytes)).first;
    if (at != held_.begin()) {
      auto prev = std::prev(at);
      if (prev->first + prev->second.size() == at->first) {
        prev->second.insert(prev->second.end(), at->second.begin(), at->second.end());
        held_.erase(at);
        at = prev;
      }
    }
    if (auto after = std::next(at); after != held_.end() && at->first + at->second.size() == after->first) {
      at->second.insert(at->second.end(), after->second.begin(), after->second.end());
      held_.erase(after);
    }
  }
  return fetched;
}

bool can_read_ranged(const protocol::ObjectRef& ref, const std::string& delta_format) {
  return !ref.header_sha256.empty() && delta_format == "compact";
}

RangedDelta read_needed(const RangeGet& get, const protocol::ObjectRef& ref, const NeededRanges& needed, const PartScope& scope,
                        const ReadOptions& options, const std::string& label) {
  RangedDelta out;
  RangeReader reader(get, ref.size, label);
  // The header: its length, then it -- two small reads, no more (a guess at its size would read
  // data bytes this rank may not need, which on a small object is most of what it reads).
  const ByteRange first{0, std::min<uint64_t>(8, ref.size)};
  reader.fetch(std::span(&first, 1));
  const uint64_t prefix_bytes = header_prefix_bytes(reader.view(first), ref.size, label);
  const ByteRange whole_header{0, prefix_bytes};
  reader.fetch(std::span(&whole_header, 1));
  const SealedHeader header = read_sealed_header(reader.view(whole_header), ref, label);
  const auto format = header.metadata.find("format");
  if (format == header.metadata.end() || format->second != "compact")
    throw BadInputError(label + ": manifest says compact, the header does not (format metadata)");
  if (compact::indexed::read_layout_version(header.metadata, label) == compact::kLayout2)
    read_indexed(reader, header, needed, scope, options, label, out);
  else
    read_chunked(reader, header, needed, scope, options, label, out);
  out.bytes_fetched = reader.bytes();
  out.requests = reader.requests();
  out.head_bytes = out.bytes_fetched - out.index_bytes - out.block_bytes;
  return out;
}

RangedDelta fetch_needed(Store& store, const protocol::ObjectRef& ref, const NeededRanges& needed, const PartScope& scope,
                         const ReadOptions& options) {
  const RangeGet get = [&](uint64_t offset, uint64_t length) { return store.get_range(ref.key, offset, length); };
  return read_needed(get, ref, needed, scope, options, store.describe(ref.key));
}

}  // namespace deltasync::ranged
