// The block index: byte layout and the strict parser (see compact_block_index.hpp).
#include "codec/compact_block_index.hpp"

#include "core/error.hpp"
#include "core/little_endian.hpp"
#include "core/tensor_meta.hpp"

namespace deltasync::compact {

using ::deltasync::detail::load_le;
using ::deltasync::detail::store_le;

namespace {

// The product of the dimensions, refused past 2^64 (a shape read from a file).
uint64_t checked_numel(std::span<const uint64_t> shape, const std::string& where) {
  uint64_t n = 1;
  for (const uint64_t d : shape)
    if (__builtin_mul_overflow(n, d, &n)) throw BadInputError(where + ": tensor of shape " + shape_text(shape) + " has more than 2^64 elements");
  return n;
}

}  // namespace

void write_header(const IndexHeader& h, uint32_t index_version, uint8_t* out) {
  store_le(out, h.changed);
  store_le(out + 8, h.payload_bytes);
  store_le(out + 16, h.block_elements);
  store_le(out + 20, h.num_blocks);
  if (index_version < kIndexVersion2) return;
  store_le(out + 24, h.bands);
  store_le(out + 28, h.stripes);
}

IndexHeader read_header(const uint8_t* in, uint32_t index_version) {
  IndexHeader h{load_le<uint64_t>(in), load_le<uint64_t>(in + 8), load_le<uint32_t>(in + 16), load_le<uint32_t>(in + 20)};
  if (index_version >= kIndexVersion2) {
    h.bands = load_le<uint32_t>(in + 24);
    h.stripes = load_le<uint32_t>(in + 28);
  }
  return h;
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

BlockRecords read_block_records(std::span<const uint8_t> block_index, uint64_t payload_bytes, std::span<const uint64_t> shape,
                                uint32_t index_version, const std::string& where) {
  if (!is_known_index_version(index_version))
    throw BadInputError(where + ": unknown compact_index_version " + std::to_string(index_version));
  const size_t header_bytes = index_header_bytes(index_version);
  if (block_index.size() < header_bytes)
    throw BadInputError(where + ": block index truncated (" + std::to_string(block_index.size()) + " bytes)");
  const IndexHeader header = read_header(block_index.data(), index_version);
  if (block_index.size() != header_bytes + uint64_t{header.num_blocks} * kRecordBytes)
    throw BadInputError(where + ": block index has " + std::to_string(block_index.size()) + " bytes for " +
                std::to_string(header.num_blocks) + " blocks");
  if (header.changed == 0 || header.num_blocks == 0) throw BadInputError(where + ": block index lists no changes");
  if (header.block_elements == 0) throw BadInputError(where + ": block index has block_elements 0");
  if (header.payload_bytes != payload_bytes)
    throw BadInputError(where + ": payload has " + std::to_string(payload_bytes) + " bytes, block index says " +
                std::to_string(header.payload_bytes));
  if (const auto unfit = tiles_unfit(shape, header.bands, header.stripes))
    throw BadInputError(where + ": block index: " + *unfit + " (shape " + shape_text(shape) + ")");
  BlockRecords out;
  out.index_version = index_version;
  out.changed = header.changed;
  out.block_elements = header.block_elements;
  out.tiles = tensor_geometry(shape, header.bands, header.stripes);
  const uint64_t numel = checked_numel(shape, where);
  out.blocks.resize(header.num_blocks);
  uint64_t next_offset = 0;
  uint64_t total_count = 0;
  for (uint32_t b = 0; b < header.num_blocks; ++b) {
    const BlockRecord r = read_record(block_index.data() + header_bytes + size_t{b} * kRecordBytes);
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

std::vector<uint8_t> write_block_index(const BlockRecords& records) {
  const size_t header_bytes = index_header_bytes(records.index_version);
  std::vector<uint8_t> out(header_bytes + records.blocks.size() * kRecordBytes);
  IndexHeader header;
  header.block_elements = records.block_elements;
  header.num_blocks = static_cast<uint32_t>(records.blocks.size());
  header.bands = records.tiles.bands;
  header.stripes = records.tiles.stripes;
  for (size_t b = 0; b < records.blocks.size(); ++b) {
    header.changed += records.blocks[b].count;
    header.payload_bytes += records.blocks[b].payload_bytes();
    write_record(records.blocks[b], out.data() + header_bytes + b * kRecordBytes);
  }
  write_header(header, records.index_version, out.data());
  return out;
}

ParsedBlockIndex parse_block_index(std::span<const uint8_t> block_index, std::span<const uint8_t> payload,
                                   size_t base_index, std::span<const uint64_t> shape, uint32_t index_version,
                                   const std::string& where) {
  BlockRecords records = read_block_records(block_index, payload.size(), shape, index_version, where);
  ParsedBlockIndex parsed;
  parsed.base_index = base_index;
  parsed.payload = payload;
  parsed.changed = records.changed;
  parsed.tiles = records.tiles;
  parsed.blocks = std::move(records.blocks);
  return parsed;
}

}  // namespace deltasync::compact
