// The block index: byte layout and the strict parser (see compact_block_index.hpp).
#include "codec/compact_block_index.hpp"

#include "core/error.hpp"
#include "core/little_endian.hpp"

namespace deltasync::compact {

using ::deltasync::detail::load_le;
using ::deltasync::detail::store_le;

void write_header(const IndexHeader& h, uint8_t* out) {
  store_le(out, h.changed);
  store_le(out + 8, h.payload_bytes);
  store_le(out + 16, h.block_elements);
  store_le(out + 20, h.num_blocks);
}

IndexHeader read_header(const uint8_t* in) {
  return IndexHeader{load_le<uint64_t>(in), load_le<uint64_t>(in + 8), load_le<uint32_t>(in + 16),
                     load_le<uint32_t>(in + 20)};
}

void write_record(const BlockRecord& r, uint8_t* out) {
  store_le(out, r.first_position);
  store_le(out + 8, r.payload_offset);
  store_le(out + 16, r.count);
  store_le(out + 20, r.table_bytes);
  store_le(out + 24, r.rans_bytes);
  store_le(out + 28, r.bits_bytes);
}

BlockRecord read_record(const uint8_t* in) {
  return BlockRecord{load_le<uint64_t>(in),      load_le<uint64_t>(in + 8),  load_le<uint32_t>(in + 16),
                     load_le<uint32_t>(in + 20), load_le<uint32_t>(in + 24), load_le<uint32_t>(in + 28)};
}

ParsedBlockIndex parse_block_index(std::span<const uint8_t> block_index, std::span<const uint8_t> payload,
                                   size_t base_index, uint64_t numel, const std::string& where) {
  ParsedBlockIndex parsed;
  parsed.base_index = base_index;
  parsed.payload = payload;
  if (block_index.size() < kIndexHeaderBytes)
    throw Error(where + ": block index truncated (" + std::to_string(block_index.size()) + " bytes)");
  const IndexHeader header = read_header(block_index.data());
  if (block_index.size() != kIndexHeaderBytes + uint64_t{header.num_blocks} * kRecordBytes)
    throw Error(where + ": block index has " + std::to_string(block_index.size()) + " bytes for " +
                std::to_string(header.num_blocks) + " blocks");
  if (header.changed == 0 || header.num_blocks == 0) throw Error(where + ": block index lists no changes");
  if (header.changed > numel)
    throw Error(where + ": " + std::to_string(header.changed) + " changes for a tensor of " + std::to_string(numel) +
                " elements");
  if (header.block_elements == 0) throw Error(where + ": block index has block_elements 0");
  if (header.payload_bytes != payload.size())
    throw Error(where + ": payload has " + std::to_string(payload.size()) + " bytes, block index says " +
                std::to_string(header.payload_bytes));
  parsed.changed = header.changed;
  parsed.blocks.resize(header.num_blocks);
  uint64_t next_offset = 0;
  uint64_t total_count = 0;
  for (uint32_t b = 0; b < header.num_blocks; ++b) {
    const BlockRecord r = read_record(block_index.data() + kIndexHeaderBytes + size_t{b} * kRecordBytes);
    const std::string block = where + ": block " + std::to_string(b);
    if (r.count == 0 || r.count > header.block_elements)
      throw Error(block + ": count " + std::to_string(r.count) + " outside 1.." + std::to_string(header.block_elements));
    // Blocks tile the payload in order: this rejects offsets outside it, overlaps and gaps.
    if (r.payload_offset != next_offset)
      throw Error(block + ": payload offset " + std::to_string(r.payload_offset) + " (expected " +
                  std::to_string(next_offset) + ")");
    if (r.payload_bytes() > payload.size() - next_offset)
      throw Error(block + ": " + std::to_string(r.payload_bytes()) + " payload bytes run past the end of the payload");
    if (r.first_position >= numel)
      throw Error(block + ": first position " + std::to_string(r.first_position) + " is outside the tensor (" +
                  std::to_string(numel) + " elements)");
    if (b > 0 && r.first_position <= parsed.blocks[b - 1].first_position)
      throw Error(block + ": first position " + std::to_string(r.first_position) + " is not after the previous block's");
    next_offset += r.payload_bytes();
    total_count += r.count;
    parsed.blocks[b] = r;
  }
  if (next_offset != payload.size())
    throw Error(where + ": payload has " + std::to_string(payload.size() - next_offset) + " trailing bytes");
  if (total_count != header.changed)
    throw Error(where + ": block counts sum to " + std::to_string(total_count) + ", block index says " +
                std::to_string(header.changed));
  return parsed;
}

}  // namespace deltasync::compact
