#include "sync/ranged_fetch.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "format/safetensors.hpp"

namespace deltasync::ranged {

bool can_read_ranged(const protocol::ObjectRef& ref, const std::string& delta_format) {
  return !ref.header_sha256.empty() && delta_format == "compact";
}

RangedDelta fetch_needed(Store& store, const protocol::ObjectRef& ref, const NeededRanges& needed, const PartScope& scope) {
  const std::string label = store.describe(ref.key);
  RangedDelta out;
  auto get = [&](uint64_t offset, uint64_t length) {
    std::vector<uint8_t> bytes = store.get_range(ref.key, offset, length);
    ++out.requests;
    out.bytes_fetched += bytes.size();
    if (bytes.size() != length)
      throw BadInputError(label + ": ranged read of [" + std::to_string(offset) + ", +" + std::to_string(length) + ") returned " +
                          std::to_string(bytes.size()) + " bytes (object shorter than its manifest says)");
    return bytes;
  };
  // The length, then the header: two small reads (a guess at the header's size would fetch data
  // bytes this rank may not need).
  std::vector<uint8_t> prefix = get(0, 8);
  const uint64_t prefix_bytes = header_prefix_bytes(prefix, ref.size, label);
  const std::vector<uint8_t> rest = get(8, prefix_bytes - 8);
  prefix.insert(prefix.end(), rest.begin(), rest.end());
  const SealedHeader header = read_sealed_header(prefix, ref, label);
  const auto format = header.metadata.find("format");
  if (format == header.metadata.end() || format->second != "compact")
    throw BadInputError(label + ": manifest says compact, the header does not (format metadata)");

  // Verified data ranges by their data-section offset.
  std::map<uint64_t, std::vector<uint8_t>> have;
  auto fetch = [&](const std::vector<ByteRange>& ranges) {
    for (const ByteRange& r : ranges) {
      std::vector<uint8_t> bytes = get(header.data_offset + r.offset, r.length);
      verify_chunks(header, r.offset, bytes, label);
      // Kept merged with a range it touches (block chunks continue index chunks), so that any
      // fetched range is one span.
      auto next = have.emplace(r.offset, std::move(bytes)).first;
      if (next != have.begin()) {
        auto prev = std::prev(next);
        if (prev->first + prev->second.size() == next->first) {
          prev->second.insert(prev->second.end(), next->second.begin(), next->second.end());
          have.erase(next);
          next = prev;
        }
      }
      auto after = std::next(next);
      if (after != have.end() && next->first + next->second.size() == after->first) {
        next->second.insert(next->second.end(), after->second.begin(), after->second.end());
        have.erase(after);
      }
    }
  };
  auto view = [&](ByteRange r) -> std::span<const uint8_t> {
    auto it = have.upper_bound(r.offset);
    if (it == have.begin()) throw Error(label + ": internal: byte range not fetched");
    --it;
    if (r.end() > it->first + it->second.size()) throw Error(label + ": internal: byte range not fetched");
    return std::span<const uint8_t>(it->second).subspan(r.offset - it->first, r.length);
  };

  const IndexReads index = plan_index_reads(header, needed, scope, label);
  fetch(whole_chunks(index.ranges, header.chunk_ends));
  auto cindex = [&](const std::string& tensor) {
    const st::TensorInfo* t = header.find(tensor + ".cindex");
    return view({t->begin, t->nbytes()});
  };
  const ObjectReadPlan plan = plan_object_reads(header, needed, scope, cindex, label);
  fetch(plan.block_chunks);

  std::vector<compact::BlockSubset> subsets;
  subsets.reserve(plan.blocks.size());
  std::vector<st::WriteTensor> writes;
  uint64_t changed = 0;
  for (const BlockReads& reads : plan.blocks) {
    std::vector<std::span<const uint8_t>> payloads;
    for (const ByteRange& r : reads.ranges) payloads.push_back(view(r));
    subsets.push_back(compact::build_block_subset(reads.records, reads.chosen, payloads, label + ": tensor " + reads.tensor));
    changed += subsets.back().changed;
  }
  for (size_t k = 0; k < subsets.size(); ++k) {
    const std::string& name = plan.blocks[k].tensor;
    writes.push_back({name + ".cindex", DType::U8, {subsets[k].block_index.size()}, subsets[k].block_index});
    writes.push_back({name + ".cdata", DType::U8, {subsets[k].payload.size()}, subsets[k].payload});
  }
  // The original metadata (promises, a part's partials, tensor shapes), with the change count of
  // what this file holds: the decoder checks the blocks against it.
  st::Metadata metadata = header.metadata;
  if (metadata.count("total_changed_elements")) metadata["total_changed_elements"] = std::to_string(changed);
  out.file = st::serialize(writes, metadata);
  return out;
}

}  // namespace deltasync::ranged
