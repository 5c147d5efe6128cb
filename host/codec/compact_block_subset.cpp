#include "codec/compact_block_subset.hpp"

#include "core/error.hpp"

namespace deltasync::compact {

std::vector<uint32_t> blocks_overlapping(std::span<const BlockRecord> blocks, uint64_t numel,
                                         std::span<const ElementSpan> needed) {
  std::vector<uint32_t> out;
  size_t s = 0;
  for (size_t b = 0; b < blocks.size(); ++b) {
    const uint64_t begin = blocks[b].first_position;
    const uint64_t end = b + 1 < blocks.size() ? blocks[b + 1].first_position : numel;
    while (s < needed.size() && needed[s].end <= begin) ++s;  // spans wholly before this block
    if (s == needed.size()) break;
    if (needed[s].begin < end) out.push_back(static_cast<uint32_t>(b));
  }
  return out;
}

BlockSubset build_block_subset(const BlockRecords& records, std::span<const uint32_t> chosen,
                               std::span<const std::span<const uint8_t>> payloads, uint64_t numel, const std::string& where) {
  if (chosen.empty() || chosen.size() != payloads.size())
    throw BadInputError(where + ": " + std::to_string(chosen.size()) + " blocks chosen for " + std::to_string(payloads.size()) +
                        " payloads");
  BlockSubset out;
  std::vector<BlockRecord> kept;
  kept.reserve(chosen.size());
  for (size_t k = 0; k < chosen.size(); ++k) {
    if (chosen[k] >= records.blocks.size() || (k > 0 && chosen[k] <= chosen[k - 1]))
      throw BadInputError(where + ": block " + std::to_string(chosen[k]) + " chosen out of order or not in the index");
    BlockRecord r = records.blocks[chosen[k]];
    if (payloads[k].size() != r.payload_bytes())
      throw BadInputError(where + ": block " + std::to_string(chosen[k]) + ": payload has " + std::to_string(payloads[k].size()) +
                          " bytes, its record says " + std::to_string(r.payload_bytes()));
    r.payload_offset = out.payload.size();  // rebased: the kept blocks tile the new payload
    out.payload.insert(out.payload.end(), payloads[k].begin(), payloads[k].end());
    out.changed += r.count;
    kept.push_back(r);
  }
  IndexHeader header;
  header.changed = out.changed;
  header.payload_bytes = out.payload.size();
  header.block_elements = records.block_elements;
  header.num_blocks = static_cast<uint32_t>(kept.size());
  out.block_index.resize(kIndexHeaderBytes + kept.size() * kRecordBytes);
  write_header(header, out.block_index.data());
  for (size_t k = 0; k < kept.size(); ++k) write_record(kept[k], out.block_index.data() + kIndexHeaderBytes + k * kRecordBytes);
  (void)parse_block_index(out.block_index, out.payload, 0, numel, where);  // what every decoder checks, checked here too
  return out;
}

}  // namespace deltasync::compact
