#include "sync/ranged_plan.hpp"

#include <algorithm>

#include "codec/compact_codec.hpp"
#include "core/error.hpp"

namespace deltasync::ranged {

std::vector<ByteRange> whole_chunks(std::vector<ByteRange> ranges, std::span<const uint64_t> chunk_ends) {
  const uint64_t data_bytes = chunk_ends.empty() ? 0 : chunk_ends.back();
  std::vector<ByteRange> rounded;
  for (const auto& r : ranges) {
    if (r.length == 0) continue;
    if (r.offset > data_bytes || r.length > data_bytes - r.offset)
      throw BadInputError("byte range [" + std::to_string(r.offset) + ", +" + std::to_string(r.length) + ") runs past the " +
                          std::to_string(data_bytes) + "-byte data section");
    // The chunk holding the first byte begins where the chunk before it ends; the one holding the
    // last byte ends at the first end at or after the range's.
    const auto first = std::upper_bound(chunk_ends.begin(), chunk_ends.end(), r.offset);
    const uint64_t begin = first == chunk_ends.begin() ? 0 : *std::prev(first);
    const uint64_t end = *std::lower_bound(first, chunk_ends.end(), r.end());
    rounded.push_back({begin, end - begin});
  }
  return merge_gaps(std::move(rounded), 0);
}

std::vector<ByteRange> merge_gaps(std::vector<ByteRange> ranges, uint64_t gap_bytes, GapCap cap) {
  std::sort(ranges.begin(), ranges.end(), [](const auto& a, const auto& b) { return a.offset < b.offset; });
  std::vector<ByteRange> out;
  uint64_t wanted = 0, dropped = 0;  // out.back()'s bytes asked for and gap bytes read through
  for (const auto& r : ranges) {
    if (r.length == 0) continue;
    if (!out.empty() && r.offset <= out.back().end()) {  // overlapping or touching: always one read
      const uint64_t end = std::max(out.back().end(), r.end());
      wanted += end - out.back().end();
      out.back().length = end - out.back().offset;
      continue;
    }
    const uint64_t gap = out.empty() ? 0 : r.offset - out.back().end();
    if (!out.empty() && gap <= gap_bytes && (cap == GapCap::kNone || (dropped + gap) * kGapShare <= wanted + r.length)) {
      dropped += gap;
      wanted += r.length;
      out.back().length = r.end() - out.back().offset;
    } else {
      out.push_back(r);
      wanted = r.length;
      dropped = 0;
    }
  }
  return out;
}

bool placement_overlaps(const Placement& p, std::span<const ElementSpan> spans) {
  if (p.empty()) return false;
  for (const auto& s : spans) {
    if (s.end <= p.first || s.begin >= p.end()) continue;
    // The first run that ends after the span begins; the span meets the shard iff that run
    // starts before the span ends.
    uint64_t r = 0;
    if (p.run_count > 1 && s.begin >= p.first + p.run_length) r = (s.begin - p.first - p.run_length) / p.run_stride + 1;
    if (r < p.run_count && p.first + r * p.run_stride < s.end) return true;
  }
  return false;
}

IndexReads plan_index_reads(const SealedHeader& header, const NeededRanges& needed, const PartScope& scope, const std::string& label) {
  static constexpr std::string_view kIndex = ".cindex", kData = ".cdata";
  IndexReads out;
  for (const auto& t : header.tensors) {
    std::string_view name = t.name;
    if (name.ends_with(kData)) {
      if (!header.find(std::string(name.substr(0, name.size() - kData.size())) + std::string(kIndex)))
        throw BadInputError(label + ": tensor " + t.name + " has no block index");
      continue;
    }
    if (!name.ends_with(kIndex)) throw BadInputError(label + ": tensor " + t.name + " is not part of a compact delta");
    const std::string base(name.substr(0, name.size() - kIndex.size()));
    if (!header.find(base + std::string(kData))) throw BadInputError(label + ": tensor " + t.name + " has no payload");
    const auto want = needed.find(base);
    if (want == needed.end() || want->second.spans.empty()) continue;
    if (scope.placements && !placement_overlaps(scope.placements->placement(base, scope.part), want->second.spans)) continue;
    out.tensors.push_back(base);
    out.ranges.push_back({t.begin, t.nbytes()});
  }
  return out;
}

BlockReads plan_block_reads(const SealedHeader& header, const std::string& tensor, std::span<const uint8_t> cindex,
                            const NeededTensor& needed, const std::string& label) {
  const st::TensorInfo* data = header.find(tensor + ".cdata");
  if (!data) throw BadInputError(label + ": tensor " + tensor + ".cdata is missing");
  BlockReads out;
  out.tensor = tensor;
  out.records = compact::read_block_records(cindex, data->nbytes(), needed.shape, compact::read_index_version(header.metadata, label),
                                           label + ": tensor " + tensor);
  out.chosen = compact::blocks_overlapping(out.records, needed.spans);
  for (uint32_t b : out.chosen) {
    const auto& r = out.records.blocks[b];
    out.ranges.push_back({data->begin + r.payload_offset, r.payload_bytes()});
  }
  return out;
}

uint64_t ObjectReadPlan::bytes() const {
  uint64_t total = header_bytes;
  for (const auto& r : index_chunks) total += r.length;
  for (const auto& r : block_chunks) total += r.length;
  return total;
}

ObjectReadPlan plan_object_reads(const SealedHeader& header, const NeededRanges& needed, const PartScope& scope,
                                 const std::function<std::span<const uint8_t>(const std::string&)>& cindex, const std::string& label,
                                 uint64_t gap_bytes) {
  ObjectReadPlan plan;
  plan.header_bytes = header.data_offset;
  const IndexReads index = plan_index_reads(header, needed, scope, label);
  plan.index_chunks = merge_gaps(whole_chunks(index.ranges, header.chunk_ends), gap_bytes);
  std::vector<ByteRange> blocks;
  for (const std::string& t : index.tensors) {
    BlockReads reads = plan_block_reads(header, t, cindex(t), needed.find(t)->second, label);
    if (reads.chosen.empty()) continue;
    blocks.insert(blocks.end(), reads.ranges.begin(), reads.ranges.end());
    plan.blocks.push_back(std::move(reads));
  }
  // Chunks the index reads already brought (a small tensor's index and blocks share one) are not read twice.
  for (const ByteRange& r : merge_gaps(whole_chunks(std::move(blocks), header.chunk_ends), gap_bytes)) {
    uint64_t at = r.offset;
    for (const ByteRange& have : plan.index_chunks) {
      if (have.end() <= at || have.offset >= r.end()) continue;
      if (have.offset > at) plan.block_chunks.push_back({at, have.offset - at});
      at = std::max(at, have.end());
    }
    if (at < r.end()) plan.block_chunks.push_back({at, r.end() - at});
  }
  return plan;
}

std::vector<ObjectReadPlan> plan_delta_reads(
    const protocol::Manifest& manifest, std::span<const SealedHeader> headers, const NeededRanges& needed,
    const std::function<std::span<const uint8_t>(size_t, const std::string&)>& cindex) {
  const std::vector<protocol::ObjectRef> objects = protocol::delta_objects(manifest);
  const std::string label = "version " + std::to_string(manifest.version);
  if (headers.size() != objects.size())
    throw BadInputError(label + ": " + std::to_string(headers.size()) + " headers for " + std::to_string(objects.size()) + " delta objects");
  std::vector<ObjectReadPlan> out;
  for (size_t k = 0; k < objects.size(); ++k) {
    const PartScope scope{manifest.delta_parts.empty() ? nullptr : &manifest.part_placements, k};
    out.push_back(plan_object_reads(headers[k], needed, scope,
                                    [&](const std::string& tensor) { return cindex(k, tensor); }, objects[k].key));
  }
  return out;
}

}  // namespace deltasync::ranged
