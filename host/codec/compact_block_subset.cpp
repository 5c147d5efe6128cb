#include "codec/compact_block_subset.hpp"

#include "core/error.hpp"

namespace deltasync::compact {

BlockRecords read_block_records(std::span<const uint8_t> block_index, uint64_t payload_bytes, uint64_t numel,
                                const std::string& where) {
  if (block_index.size() < kIndexHeaderBytes)
    throw BadInputError(where + ": block index truncated (" + std::to_string(block_index.size()) + " bytes)");
  const IndexHeader header = read_header(block_index.data());
  if (block_index.size() != kIndexHeaderBytes + uint64_t{header.num_blocks} * kRecordBytes)
    throw BadInputError(where + ": block index has " + std::to_string(block_index.size()) + " bytes for " +
                        std::to_string(header.num_blocks) + " blocks");
  if (header.num_blocks == 0 || header.block_elements == 0) throw BadInputError(where + ": block index lists no blocks");
  if (header.payload_bytes != payload_bytes)
    throw BadInputError(where + ": payload has " + std::to_string(payload_bytes) + " bytes, block index says " +
                        std::to_string(header.payload_bytes));
  BlockRecords out;
  out.block_elements = header.block_elements;
  out.blocks.resize(header.num_blocks);
  uint64_t next_offset = 0;
  for (uint32_t b = 0; b < header.num_blocks; ++b) {
    const BlockRecord r = read_record(block_index.data() + kIndexHeaderBytes + size_t{b} * kRecordBytes);
    const std::string block = where + ": block " + std::to_string(b);
    // What the byte ranges to fetch are computed from: each block inside the payload, in order.
    if (r.payload_offset != next_offset || r.payload_bytes() > payload_bytes - next_offset)
      throw BadInputError(block + ": payload [" + std::to_string(r.payload_offset) + ", +" + std::to_string(r.payload_bytes()) +
                          ") does not follow the previous block inside the payload");
    if (r.first_position >= numel || (b > 0 && r.first_position <= out.blocks[b - 1].first_position))
      throw BadInputError(block + ": first position " + std::to_string(r.first_position) +
                          " is outside the tensor or not after the previous block's");
    next_offset += r.payload_bytes();
    out.blocks[b] = r;
  }
  if (next_offset != payload_bytes)
    throw BadInputError(where + ": payload has " + std::to_string(payload_bytes - next_offset) + " trailing bytes");
  return out;
}

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
