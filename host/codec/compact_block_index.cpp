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

BlockRecords read_block_records(std::span<const uint8_t> block_index, uint64_t payload_bytes, uint64_t numel,
                                const std::string& where) {
  if (block_index.size() < kIndexHeaderBytes)
    throw BadInputError(where + ": block index truncated (" + std::to_string(block_index.size()) + " bytes)");
  const IndexHeader header = read_header(block_index.data());
  if (block_index.size() != kIndexHeaderBytes + uint64_t{header.num_blocks} * kRecordBytes)
    throw BadInputError(where + ": block index has " + std::to_string(block_index.size()) + " bytes for " +
                std::to_string(header.num_blocks) + " blocks");
  if (header.changed == 0 || header.num_blocks == 0) throw BadInputError(where + ": block index lists no changes");
  if (header.block_elements == 0) throw BadInputError(where + ": block index has block_elements 0");
  if (header.payload_bytes != payload_bytes)
    throw BadInputError(where + ": payload has " + std::to_string(payload_bytes) + " bytes, block index says " +
                std::to_string(header.payload_bytes));
  BlockRecords out;
  out.changed = header.changed;
  out.block_elements = header.block_elements;
  out.blocks.resize(header.num_blocks);
  uint64_t next_offset = 0;
  uint64_t total_count = 0;
  for (uint32_t b = 0; b < header.num_blocks; ++b) {
    const BlockRecord r = read_record(block_index.data() + kIndexHeaderBytes + size_t{b} * kRecordBytes);
    const std::string block = where + ": block " + std::to_string(b);
    if (r.count == 0 || r.count > header.block_elements)
      throw BadInputError(block + ": count " + std::to_string(r.count) + " outside 1.." + std::to_string(header.block_elements));
    // Blocks tile the payload in order: this rejects offsets outside it, overlaps and gaps.
    if (r.payload_offset != next_offset)
      throw BadInputError(block + ": payload offset " + std::to_string(r.payload_offset) + " (expected " +
                  std::to_string(next_offset) + ")");
    if (r.payload_bytes() > payload_bytes - next_offset)
      throw BadInputError(block + ": " + std::to_string(r.payload_bytes()) + " payload bytes run past the end of the payload");
    if (r.first_position >= numel)
      throw BadInputError(block + ": first position " + std::to_string(r.first_position) + " is outside the tensor (" +
                  std::to_string(numel) + " elements)");
    if (b > 0 && r.first_position <= out.blocks[b - 1].first_position)
      throw BadInputError(block + ": first position " + std::to_string(r.first_position) + " is not after the previous block's");
    next_offset += r.payload_bytes();
    total_count += r.count;
    out.blocks[b] = r;
  }
  if (next_offset != payload_bytes)
    throw BadInputError(where + ": payload has " + std::to_string(payload_bytes - next_offset) + " trailing bytes");
  if (total_count != header.changed)
    throw BadInputError(where + ": block counts sum to " + std::to_string(total_count) + ", block index says " +
                std::to_string(header.changed));
  // Counts sum to `changed` and every block starts inside the tensor at ascending positions, so
  // this holds unless the blocks' positions run out of the tensor (the decoder checks those).
  if (header.changed > numel)
    throw BadInputError(where + ": " + std::to_string(header.changed) + " changes for a tensor of " + std::to_string(numel) +
                " elements");
  return out;
}

ParsedBlockIndex parse_block_index(std::span<const uint8_t> block_index, std::span<const uint8_t> payload,
                                   size_t base_index, uint64_t numel, const std::string& where) {
  BlockRecords records = read_block_records(block_index, payload.size(), numel, where);
  ParsedBlockIndex parsed;
  parsed.base_index = base_index;
  parsed.payload = payload;
  parsed.changed = records.changed;
  parsed.blocks = std::move(records.blocks);
  return parsed;
}

}  // namespace deltasync::compact
